"""Telemetry: JSON-lines logs (one file per process run, rotated by size; on S3 too), the round log and TensorBoard, an island's metrics,
logs and heartbeat report, and progress lines that only a terminal sees."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
import torch

from conftest import island_on, one_island_config, tiny_config
from coordinator.runlog import RunLog
from diloco.checkpoint import CheckpointStore
from diloco.jsonlog import JsonLines, LogError, check_tensorboard, read_log, tensorboard_writer
from diloco.progress import Progress
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest
from islands.client import CoordinatorClient
from islands.telemetry import IslandTelemetry, MetricsServer, TelemetryOptions, flops_per_token, gpu_peak_flops


def events(path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def text_of(acc, tag: str = "config/text_summary") -> str:
    return b"".join(e.tensor_proto.string_val[0] for e in acc.Tensors(tag)).decode()


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# --- JSON lines --------------------------------------------------------------------------------------


LOG_NAME = r"run-\d{8}T\d{6}(-\d+)?\.jsonl"


@pytest.mark.unit
def test_one_file_per_run_each_record_written_at_once_in_order_and_json_safe(tmp_path):
    lines = JsonLines(str(tmp_path / "logs"), "run", flush_s=3600)
    try:
        lines.write({"loss": math.nan, "inf": math.inf, "nested": {"x": [1.5, -math.inf]}, "path": tmp_path})
        (first,) = (tmp_path / "logs").iterdir()  # written at once, no flush: a crash would not lose it
        assert re.fullmatch(LOG_NAME, first.name) and "-" not in first.name[len("run-"):]
        assert json.loads(first.read_text()) == {"loss": None, "inf": None, "nested": {"x": [1.5, None]}, "path": str(tmp_path)}

        def writer(t: int) -> None:
            for i in range(300):
                lines.write({"thread": t, "i": i})

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        lines.close()
    assert [p.name for p in (tmp_path / "logs").iterdir()] == [first.name]  # one file: 1,201 records, far below 64 MB
    records = read_log(str(tmp_path / "logs"), "run")  # strict JSON: no NaN
    assert len(records) == 1 + 4 * 300
    for t in range(4):
        assert [r["i"] for r in records[1:] if r["thread"] == t] == list(range(300)), "lost, doubled or reordered"


@pytest.mark.unit
def test_a_log_rotates_past_its_size_into_numbered_parts_read_back_in_order(tmp_path):
    record = {"pad": "x" * 80}  # about 100 bytes a line: ten to a part
    lines = JsonLines(str(tmp_path / "logs"), "run", rotate_bytes=1000)
    for i in range(35):
        lines.write({"i": i, **record})
    lines.close()
    files = sorted(p.name for p in (tmp_path / "logs").iterdir())
    started = files[-1][len("run-"):-len(".jsonl")]
    assert files == sorted([f"run-{started}.jsonl"] + [f"run-{started}-{k}.jsonl" for k in (1, 2, 3)])
    assert all((tmp_path / "logs" / f).stat().st_size <= 1000 for f in files)
    assert [r["i"] for r in read_log(str(tmp_path / "logs"), "run")] == list(range(35))  # `-1` sorts before the first
    # Another process's run of the same log (a restart): after this one's records; other prefixes are not read.
    (tmp_path / "logs" / "run-29990101T000000.jsonl").write_text('{"i": 35}\n')
    (tmp_path / "logs" / "run-g1-20000101T000000.jsonl").write_text('{"i": -1}\n')
    assert [r["i"] for r in read_log(str(tmp_path / "logs"), "run")] == list(range(36))


@pytest.mark.unit
def test_a_failed_local_write_keeps_its_records_for_the_next(tmp_path, monkeypatch):
    lines = JsonLines(str(tmp_path / "logs"), "run")
    real_open = lines.fs.open
    monkeypatch.setattr(lines.fs, "open", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    lines.write({"i": 0})  # fails: kept
    monkeypatch.setattr(lines.fs, "open", real_open)
    lines.write({"i": 1})
    lines.close()
    assert read_log(str(tmp_path / "logs"), "run") == [{"i": 0}, {"i": 1}]


CRASHING_WRITER = """
import os, signal, sys
from diloco.jsonlog import JsonLines
lines = JsonLines(sys.argv[1], "rounds", flush_s=3600)
for i in range(50):
    lines.write({"round": i})
os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush: a crash
"""


@pytest.mark.integration
def test_a_process_killed_after_writing_loses_no_record(tmp_path):
    out = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(tmp_path / "logs")], timeout=120)
    assert out.returncode == -9
    assert [r["round"] for r in read_log(str(tmp_path / "logs"), "rounds")] == list(range(50))


def wait_for_records(url: str, prefix: str, count: int) -> list[dict]:
    """The log's records once it holds count of them (the uploader runs on its own thread); generous bound."""
    deadline = time.monotonic() + 60
    while True:
        try:
            records = read_log(url, prefix)
        except FileNotFoundError:
            records = []
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


@pytest.mark.integration
def test_on_s3_each_record_is_uploaded_at_once_parts_rotate_and_a_failed_upload_is_retried(s3, monkeypatch):
    url = f"{s3}/logs/run1"
    lines = JsonLines(url, "rounds", flush_s=3600, rotate_bytes=40)  # about three records a part
    try:
        lines.write({"round": 0})
        assert wait_for_records(url, "rounds", 1) == [{"round": 0}]  # no flush_s wait, no close
        real_pipe = lines.fs.pipe_file
        failed = threading.Event()

        def store_down(*a, **k):
            failed.set()
            raise OSError("store down")

        monkeypatch.setattr(lines.fs, "pipe_file", store_down)
        lines.write({"round": 1})
        assert failed.wait(60)
        lines.flush()  # fails again: the record stays for the next try
        monkeypatch.setattr(lines.fs, "pipe_file", real_pipe)
        for r in range(2, 8):
            lines.write({"round": r})
        assert wait_for_records(url, "rounds", 8) == [{"round": r} for r in range(8)]
    finally:
        lines.close()
    fs = fsspec.filesystem("s3")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("diloco-test/logs/run1", detail=False))
    assert len(names) == 3 and all(re.fullmatch(r"rounds-\d{8}T\d{6}(-[12])?\.jsonl", n) for n in names), names
    assert read_log(url, "rounds") == [{"round": r} for r in range(8)]


@pytest.mark.unit
def test_audit_log_keeps_its_format(tmp_path):
    from coordinator.audit import AuditLog

    audit = AuditLog(str(tmp_path / "audit"))
    audit.record("join", island="a", ranks=1)
    audit.close()
    (part,) = (tmp_path / "audit").glob("audit-*.jsonl")
    record = json.loads(part.read_text())
    assert record["event"] == "join" and record["island"] == "a" and record["time"] > 0


# --- the coordinator's round log ----------------------------------------------------------------------


def summary(round_: int, eval_loss: float) -> pb.RoundSummary:
    return pb.RoundSummary(
        round=round_, islands=["a", "b"], tokens=1024, train_loss=3.5 - round_, eval_loss=eval_loss, bytes_up=1000,
        bytes_down=3000, seconds=2.0, ddp_bytes=8000.0, initial_eval_loss=4.0, wait_s=1.5, fold_s=0.1, step_s=0.05,
        publish_s=0.2, eval_s=0.15, closed_at=time.time(), fragments=1,
        traffic=[pb.IslandTraffic(island_id="a", bytes_up=500, bytes_down=1500)],
        contributions=[pb.IslandContribution(island_id="a", tokens=512, train_loss=3.4),
                       pb.IslandContribution(island_id="b", tokens=512, train_loss=3.6)],
    )


@pytest.mark.integration
def test_run_log_writes_every_round_as_json_and_tensorboard(tmp_path):
    cfg = tiny_config("rounds.rounds=7")
    log = RunLog(str(tmp_path / "log"), str(tmp_path / "tb"), cfg)
    log.record(summary(0, math.nan))
    log.record(summary(1, 2.5))
    log.close()
    records = read_log(str(tmp_path / "log"), "rounds")
    assert records[0]["event"] == "start" and records[0]["config"]["rounds"]["rounds"] == 7
    first, second = records[1:]
    assert first["event"] == "round" and first["eval_loss"] is None and second["eval_loss"] == 2.5
    assert first["traffic_factor"] == pytest.approx(2.0) and first["bytes_up"] == 1000
    assert first["wait_s"] == 1.5 and first["publish_s"] == 0.2 and first["closed_at"] > 0
    assert first["contributions"][1] == {"island_id": "b", "tokens": 512, "train_loss": 3.6, "staleness": 0, "weight": 0.0, "codec": ""}
    assert first["traffic"] == [{"island_id": "a", "bytes_up": 500, "bytes_down": 1500}]
    assert set(pb.RoundSummary.DESCRIPTOR.fields_by_name) <= set(first)

    acc = events(tmp_path / "tb")
    scalars = acc.Tags()["scalars"]
    for tag in ("loss/train", "loss/eval", "loss/island/a", "loss/island/b", "bytes/up", "bytes/down", "traffic_factor",
                "seconds/round", "seconds/wait", "seconds/fold", "seconds/step", "seconds/publish", "seconds/eval", "tokens"):
        assert tag in scalars, tag
    assert [(e.step, e.value) for e in acc.Scalars("loss/eval")] == [(0, 4.0), (2, 2.5)]  # initial, then after round 1
    assert [e.step for e in acc.Scalars("loss/train")] == [1, 2]
    assert "steps_per_round = 2" in text_of(acc)


@pytest.mark.integration
def test_run_log_on_s3_uploads_each_round_as_it_closes_and_rotates_past_the_size(s3, monkeypatch):
    monkeypatch.setattr("diloco.jsonlog.OBJECT_ROTATE_BYTES", 4000)  # a few round records a part
    url = f"{s3}/run/log"
    log = RunLog(url, "", tiny_config("rounds.rounds=12"))
    try:
        for r in range(12):
            log.record(summary(r, 2.5))
            records = wait_for_records(url, "rounds", r + 2)  # the start record, then rounds 0..r: before any close
            assert [x["round"] for x in records[1:]] == list(range(r + 1))
    finally:
        log.close()
    names = sorted(p.rsplit("/", 1)[-1] for p in fsspec.filesystem("s3").ls("diloco-test/run/log", detail=False))
    started = min(names)[len("rounds-"):len("rounds-") + 15]
    assert len(names) > 2 and set(names) == {f"rounds-{started}.jsonl"} | {f"rounds-{started}-{k}.jsonl" for k in range(1, len(names))}
    records = read_log(url, "rounds")
    assert records[0]["event"] == "start" and [x["round"] for x in records[1:]] == list(range(12))


@pytest.mark.unit
def test_tensorboard_missing_is_one_line_saying_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as without the package
    with pytest.raises(LogError, match="pip install tensorboard") as e:
        tensorboard_writer(str(tmp_path / "tb"))
    assert "\n" not in str(e.value)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(LogError, match="pip install tensorboard"):
        check_tensorboard()
    with pytest.raises(LogError, match="pip install tensorboard"):
        RunLog("", str(tmp_path / "tb"), tiny_config())


# --- an island --------------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and line[0] != "#"}


class HeldUntilReported(IslandTelemetry):
    """Holds the island after a landing until the coordinator has its tokens/s from a heartbeat (bounded)."""

    coordinator = None

    def landed(self, island) -> None:
        super().landed(island)
        if self.report["tokens_per_s"] > 0:
            deadline = time.monotonic() + 60
            members = self.coordinator.state.members
            while not members.islands[island.island_id].report.get("tokens_per_s") and time.monotonic() < deadline:
                time.sleep(0.01)


@pytest.mark.integration
def test_island_exports_metrics_logs_tensorboard_and_heartbeat_report(make_coordinator, tmp_path, monkeypatch):
    rounds, h, window = 3, 4, 2
    cfg = one_island_config(f"rounds.rounds={rounds}", f"inner.steps_per_round={h}", "rounds.heartbeat_s=0.05",
                            "rounds.lease_s=60")
    coordinator = make_coordinator(cfg)
    options = TelemetryOptions(metrics_port=0, log_url=str(tmp_path / "log"), tensorboard_dir=str(tmp_path / "tb"),
                               window_steps=window, label="east", flush_s=3600)
    telemetry = HeldUntilReported(options)
    telemetry.coordinator = coordinator
    url = telemetry.server.url
    try:
        with island_on(coordinator, cfg) as island:
            island.telemetry = telemetry
            client = island.ctx.client
            client.start_heartbeat(lambda: island.island_id, cfg.rounds.heartbeat_s, lambda: island.round,
                                   telemetry.heartbeat_report)
            result = island.run()
            assert result.rounds == rounds and result.checksum_matches
            report = coordinator.state.members.departed[-1].report
            assert report["tokens_per_s"] > 0 and 0 < report["utilization"] <= 1 and math.isfinite(report["train_loss"])

            metrics = scrape(url)
            assert metrics["diloco_inner_steps_total"] == rounds * h
            assert metrics["diloco_inner_tokens_total"] == rounds * h * cfg.inner.batch_size * cfg.data.seq_len
            assert metrics["diloco_inner_tokens_per_second"] > 0 and metrics["diloco_inner_train_loss"] > 0
            assert 0 < metrics["diloco_inner_utilization"] <= 1 and metrics["diloco_inner_seconds_total"] > 0
            assert "diloco_inner_mfu" not in metrics  # on CPU: no peak to measure against
            assert metrics['diloco_exchange_bytes_total{direction="up"}'] == client.bytes_sent > 0
            assert metrics['diloco_exchange_bytes_total{direction="down"}'] == client.bytes_received > 0
            assert metrics['diloco_exchange_seconds_count{kind="push"}'] == rounds
            assert metrics['diloco_exchange_seconds_count{kind="pull"}'] == rounds
            assert metrics['diloco_exchange_seconds_count{kind="fetch"}'] == 1
            assert metrics['diloco_exchange_round{fragment="0"}'] == rounds - 1
            assert metrics[f'diloco_island_info{{group="0",island="{island.island_id}",rank="0"}}'] == 1
            island_id, sent = island.island_id, client.bytes_sent
    finally:
        telemetry.close()
    with pytest.raises(urllib.error.URLError):  # stopped: the port is closed
        urllib.request.urlopen(url, timeout=5)

    records = read_log(str(tmp_path / "log"), "island-east")
    start, windows, landed = (records[0], [r for r in records if r["event"] == "window"],
                              [r for r in records if r["event"] == "round"])
    assert start["event"] == "start" and start["metrics"] == url and start["config"]["inner"]["steps_per_round"] == h
    assert all(r["island"] == island_id for r in records)
    assert [(w["first_step"], w["last_step"]) for w in windows] == [(s, s + window) for s in range(0, rounds * h, window)]
    assert all(w["tokens_per_s"] > 0 and w["inner_s"] > 0 and w["wall_s"] >= w["inner_s"] and w["mfu"] is None
               for w in windows)
    assert sum(w["wait_s"] for w in windows) > 0  # the rounds' exchanges blocked the island
    assert [r["round"] for r in landed] == list(range(rounds))
    assert sum(r["bytes_up"] for r in landed) == sent and all(r["push_s"] > 0 and r["pull_s"] > 0 for r in landed)

    acc = events(tmp_path / "tb" / "island-east")
    assert {"inner/tokens_per_s", "inner/train_loss", "inner/utilization", "exchange/bytes_up", "exchange/push_s"} <= set(acc.Tags()["scalars"])
    assert len(acc.Scalars("inner/train_loss")) == rounds * h // window
    assert "steps_per_round" in text_of(acc)


@pytest.mark.integration
def test_a_taken_port_is_a_clear_error_and_the_default_writes_nothing(tmp_path):
    first = IslandTelemetry(TelemetryOptions(metrics_port=0))
    try:
        with pytest.raises(LogError, match="--metrics-port"):
            IslandTelemetry(TelemetryOptions(metrics_port=first.server.port))
    finally:
        first.close()
    quiet = IslandTelemetry()
    assert quiet.server is None and quiet.lines is None and quiet.metrics is None
    assert quiet.heartbeat_report() == {"utilization": 0.0, "tokens_per_s": 0.0, "train_loss": 0.0}
    # Ranks other than a group's rank 0 account but write nothing.
    other = IslandTelemetry(TelemetryOptions(metrics_port=0, log_url=str(tmp_path / "log")), exporting=False)
    assert other.server is None and other.lines is None and not (tmp_path / "log").exists()


@pytest.mark.integration
def test_mfu_from_model_flops_and_the_peak(tmp_path, monkeypatch):
    cfg = tiny_config()
    assert flops_per_token(1000, 2, 32, 64) == 6 * 1000 + 12 * 2 * 32 * 64
    for name, peak in [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert gpu_peak_flops(torch.device("cuda", 0)) == peak, name
    assert gpu_peak_flops(torch.device("cpu")) is None
    # An island of 2 ranks (tokens of 2 x batch x seq per step) against a given peak.
    telemetry = IslandTelemetry(TelemetryOptions(metrics_port=0, log_url=str(tmp_path / "log"), window_steps=2,
                                                 peak_flops=1e9, flush_s=3600))
    island = SimpleNamespace(
        cfg=cfg, island_id="island-7", client=SimpleNamespace(on_call=None), timing={"wait_s": 0.0},
        manifest=SimpleNamespace(total_numel=lambda: 5000), world=SimpleNamespace(device=torch.device("cpu"), rank=0),
        state=SimpleNamespace(step=0),
    )
    try:
        telemetry.attach(island)
        for _ in range(2):
            island.state.step += 1
            telemetry.inner_step(2.0, 2 * cfg.inner.batch_size * cfg.data.seq_len, 0.01)
        mfu = scrape(telemetry.server.url)["diloco_inner_mfu"]
    finally:
        telemetry.close()
    (window,) = [r for r in read_log(str(tmp_path / "log"), "island-7") if r["event"] == "window"]
    fpt = flops_per_token(5000, cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len)
    assert window["mfu"] == pytest.approx(window["tokens_per_s"] * fpt / (2 * 1e9)) == pytest.approx(mfu)


@pytest.mark.integration
def test_metrics_server_serves_and_stops():
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("probe", "a probe", registry=registry).inc(3)
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        assert scrape(server.url)["probe_total"] == 3
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


# --- progress ------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_progress_is_silent_unless_on_a_terminal_or_forced():
    quiet = io.StringIO()
    with Progress("fetching", 100, stream=quiet) as p:
        p.update(50)
    assert quiet.getvalue() == ""

    forced = io.StringIO()
    with Progress("fetching", 4 << 20, stream=forced, force=True, interval_s=0) as p:
        for _ in range(4):
            p.update(1 << 20)
    out = forced.getvalue()
    assert "\rfetching: 1.0 MiB of 4.0 MiB (25%)" in out and "left" in out
    assert out.endswith("\n") and "fetching: 4.0 MiB, done in" in out.splitlines()[-1]

    tty = Terminal()
    with Progress("prepare", unit="tokens", stream=tty, interval_s=0) as p:
        p.update(1234, "3 documents")
    assert "prepare: 3 documents, 1,234 tokens" in tty.getvalue()
    off = Terminal()
    with Progress("prepare", stream=off, enabled=False) as p:  # another rank than the one that shows it
        p.update(10)
    assert off.getvalue() == ""


@pytest.mark.integration
def test_checkpoint_and_fetch_show_progress_on_a_terminal(tmp_path, monkeypatch, make_coordinator):
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    monkeypatch.setattr("diloco.checkpoint.WORTH_SHOWING", 0)
    monkeypatch.setattr("islands.client.WORTH_SHOWING", 0)
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.save(3, {"w": torch.arange(10.0)}, {"step": 3})
    tensors, _ = store.load(3)
    assert torch.equal(tensors["w"], torch.arange(10.0))
    assert "writing checkpoint 3" in tty.getvalue() and "reading checkpoint 3" in tty.getvalue()

    cfg = tiny_config()
    coordinator = make_coordinator(cfg)
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    try:
        joined = client.join(cfg.digest())
        manifest = Manifest.from_proto(joined.parameters)
        targets = {n: torch.zeros(s) for n, s in manifest.shapes.items()}
        client.fetch(joined.island_id, targets, manifest)
        assert "fetching parameters: " in tty.getvalue() and "done in" in tty.getvalue()
        client.progress = False  # on every rank but one
        tty.seek(0)
        tty.truncate(0)
        client.fetch(joined.island_id, targets, manifest)
    finally:
        client.close()
    assert tty.getvalue() == "", "progress turned off still printed"


@pytest.mark.integration
def test_run_island_with_streaming_logs_every_fragments_exchanges_and_closes(make_coordinator, tmp_path):
    """Through run_island (what `diloco-island join` runs): overlapped exchanges of 2 fragments, each landing
    tau = 1 step after its sync on the exchange's own thread."""
    from islands.launch import run_island
    from islands.state import ReplicaSpec
    from islands.world import IslandWorld

    rounds, h = 3, 4
    cfg = one_island_config("model.n_layers=2", f"rounds.rounds={rounds}", f"inner.steps_per_round={h}", "streaming.fragments=2",
                            "streaming.tau=1")
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    try:
        result = run_island(f"127.0.0.1:{coordinator.port}", cfg, world, ReplicaSpec(), connect_timeout_s=10,
                            telemetry=TelemetryOptions(metrics_port=0, log_url=str(tmp_path / "log")))
    finally:
        world.shutdown()
    assert result.rounds == rounds and result.checksum_matches
    records = read_log(str(tmp_path / "log"), result.island_id)
    url = records[0]["metrics"]
    with pytest.raises(urllib.error.URLError):  # run_island stopped the exporter
        urllib.request.urlopen(url, timeout=5)
    landed = [(r["fragment"], r["round"]) for r in records if r["event"] == "round"]
    assert sorted(landed) == [(f, r) for f in range(2) for r in range(rounds)]
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["pushes"] == 1 for r in records if r["event"] == "round")
    windows = [r for r in records if r["event"] == "window"]
    assert sum(w["steps"] for w in windows) == rounds * h and all(w["tokens_per_s"] > 0 for w in windows)
