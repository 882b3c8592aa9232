"""The console scripts: --help, and one-line errors with exit status 2 for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from kit import StderrLines

from diloco.v1 import diloco_pb2 as pb
from diloco.wire.refusal import Reason

SCRIPTS = {
    "diloco-coordinator": [sys.executable, "-m", "coordinator"],
    "diloco-island": [sys.executable, "-m", "islands"],
    "diloco-sim": [sys.executable, "-m", "islands.sim"],
}
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def _run(argv, timeout=120):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv, flags",
    [
        (["diloco-coordinator", "serve", "--help"], ["--config", "--port", "--set", "--report"]),
        (["diloco-island", "join", "--help"], ["--coordinator", "--config", "--device"]),
        (["diloco-sim", "--help"], ["--islands", "--config", "--rounds"]),
        (["diloco-coordinator", "--help"], ["serve"]),
    ],
)
def test_help_explains_flags(argv, flags):
    out = _run(SCRIPTS[argv[0]] + argv[1:])
    assert out.returncode == 0
    for flag in flags:
        assert flag in out.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv, message",
    [
        (["diloco-coordinator", "serve", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["diloco-coordinator", "serve", "--config", "/nonexistent/run.toml"], "config file not found: /nonexistent/run.toml"),
        (["diloco-coordinator", "serve", "--set", "inner.lrr=1"], "unknown key(s) ['lrr'] in [inner]"),
        (["diloco-coordinator", "serve", "--set", "inner.lr=fast"], "inner.lr must be of type float"),
        (["diloco-island", "join", "--coordinator", "127.0.0.1:1", "--config", "/nonexistent.toml"], "config file not found"),
        (["diloco-island", "join"], "the following arguments are required: --coordinator"),
        (["diloco-island", "join", "--coordinator", "nohostport"], "must be HOST:PORT"),
        (["diloco-island", "join", "--coordinator", "127.0.0.1:9", "--threads", "-1"], "--threads -1: give a number"),
        (["diloco-sim", "--islands", "zero"], "invalid int value: 'zero'"),
        (["diloco-sim", "--config", "/nonexistent.toml"], "config file not found"),
        # A --set that would do nothing in this config (it was silently ignored).
        (["diloco-coordinator", "serve", "--config", str(TINY), "--set", "data.url=s3://bucket/corpus"],
         "error: data.url has no effect with data.source = 'synthetic'; set data.source = 'tokens'"),
    ],
)
def test_bad_input_gives_one_line_error_and_status_2(argv, message):
    out = _run(SCRIPTS[argv[0]] + argv[1:])
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert message in lines[0] and "Traceback" not in out.stderr


@pytest.mark.integration
def test_invalid_toml_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nd_model = 3")
    out = _run(SCRIPTS["diloco-coordinator"] + ["serve", "--config", str(bad)])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "is not valid TOML" in out.stderr


@pytest.mark.integration
def test_unreachable_coordinator_is_a_clear_error():
    # Port 9 on loopback: nothing listens there.
    out = _run(SCRIPTS["diloco-island"] + ["join", "--coordinator", "127.0.0.1:9", "--connect-timeout", "1"])
    assert out.returncode == 2
    assert "cannot reach the coordinator at 127.0.0.1:9" in out.stderr


def _console_scripts() -> dict[str, str]:
    import tomllib
    from pathlib import Path

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    return pyproject["project"]["scripts"]


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(_console_scripts()))
def test_help_answers_without_importing_torch(name):
    """Every command checks its arguments before the seconds of importing torch, gRPC or numpy."""
    module, function = _console_scripts()[name].split(":")
    code = (f"import sys\nfrom {module} import {function}\ntry:\n    {function}(['--help'])\nexcept SystemExit as e:\n"
            "    status = e.code\nheavy = sorted(m for m in ('torch', 'grpc', 'numpy') if m in sys.modules)\n"
            "print('STATUS', status, 'HEAVY', ','.join(heavy) or '-')")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "STATUS 0 HEAVY -", (name, out.stdout.splitlines()[-1])
    assert "usage:" in out.stdout


@pytest.mark.unit
def test_the_commands_choices_are_the_exporters():
    """diloco-export restates the exporter's dtypes and shard size so that its --help need not import torch."""
    from diloco.cli import export as cli
    from diloco.models.export import DTYPES, SHARD_BYTES

    assert sorted(cli.DTYPE_NAMES) == sorted(DTYPES)
    assert cli.SHARD_GB * 1e9 == SHARD_BYTES

@pytest.mark.unit
def test_installed_console_scripts_exist():
    import shutil

    for name in SCRIPTS:
        assert shutil.which(name), f"{name} is not on PATH; run pip install -e ."


def _old_release_island(port: int) -> list[str]:
    """An island of the previous protocol release (PROTOCOL_VERSION - 1), as a separate process."""
    code = (
        "import diloco.wire.messages, islands.client; "
        "diloco.wire.messages.PROTOCOL_VERSION = islands.client.PROTOCOL_VERSION = diloco.wire.messages.PROTOCOL_VERSION - 1; "
        f"from islands.cli import main; main(['join', '--coordinator', '127.0.0.1:{port}', '--device', 'cpu'])"
    )
    return [sys.executable, "-c", code]


@pytest.mark.integration
def test_island_of_an_older_release_gets_a_one_line_refusal(make_coordinator):
    from conftest import tiny_config

    coordinator = make_coordinator(tiny_config())
    out = _run(_old_release_island(coordinator.port))
    assert out.returncode == 2, out.stderr
    lines = _error_lines(out.stderr)
    from diloco.wire.messages import PROTOCOL_VERSION

    expected = f"protocol version {PROTOCOL_VERSION - 1} is not {PROTOCOL_VERSION}"
    assert "PROTOCOL_MISMATCH" in lines[0] and expected in lines[0], lines[0]


def _error_lines(stderr: str) -> list[str]:
    """The one error line an island's failed join ends with (after its "connecting to ..." progress lines)."""
    errors = [line for line in stderr.strip().splitlines() if "error:" in line]
    assert len(errors) == 1 and stderr.strip().endswith(errors[0]) and "Traceback" not in stderr, stderr
    return errors


@pytest.mark.integration
def test_a_config_mismatch_at_join_names_the_keys_that_differ(make_coordinator):
    # It showed only the two digests.
    from conftest import tiny_config

    coordinator = make_coordinator(tiny_config())
    out = _run(SCRIPTS["diloco-island"] + [
        "join", "--coordinator", f"127.0.0.1:{coordinator.port}", "--device", "cpu", "--config", str(TINY),
        "--set", "inner.lr=1e-3"])
    assert out.returncode == 2, out.stderr
    line = _error_lines(out.stderr)[0]
    assert "CONFIG_MISMATCH: this island's config differs from the coordinator's in " in line, line
    assert "inner.lr (here 0.001, the coordinator's 0.003)" in line and "model.d_model (here 128, the coordinator's 32)" in line
    assert "start the island with the coordinator's config file, or without --config to adopt it" in line
    assert not coordinator.state.islands


@pytest.mark.integration
def test_joining_a_finished_run_ends_quietly(make_coordinator, channel_to):
    from conftest import claim, ended, join, one_island_config, random_like, trained_from, wait_for_round
    from diloco.v1 import diloco_pb2 as pb
    from diloco.wire.messages import Manifest, tensor_chunks, uplink_codec

    cfg = one_island_config("rounds.rounds=1")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    joined = join(stub)
    codec = uplink_codec(cfg.wire)
    pg = random_like(Manifest.from_proto(joined.parameters).shapes, seed=1)
    header = pb.PushMessage(header=pb.PushHeader(island_id=joined.island_id, round=0, codec=codec.name, **claim(cfg),
                                                 global_checksum=trained_from(coordinator)))
    chunks = (pb.PushMessage(chunk=c) for c in tensor_chunks(pg, codec, cfg.wire.chunk_bytes))
    stub.PushPseudoGradient(ended([header, *chunks]), timeout=10)
    wait_for_round(coordinator, 0)
    out = _run(SCRIPTS["diloco-island"] + ["join", "--coordinator", f"127.0.0.1:{coordinator.port}", "--device", "cpu"])
    assert out.returncode == 0, out.stderr
    assert "the run has finished; nothing to do" in out.stderr


@pytest.mark.integration
def test_commands_touching_s3_fail_in_one_line_without_the_s3_librarys_chatter(s3):
    # botocore and aiobotocore log at INFO on every S3 command ("Found credentials in environment variables.", "Found
    # endpoint for s3 via: environment_global."), which made a one-line error three; --log-level debug shows them.
    island = SCRIPTS["diloco-island"] + [
        "join", "--coordinator", "127.0.0.1:9", "--connect-timeout", "1", "--device", "cpu",
        "--resume", "--checkpoint", f"{s3}/island-missing",  # lists the bucket before connecting
    ]
    evaluate = [sys.executable, "-m", "diloco.cli.eval", f"{s3}/missing", "--log-level", "info"]
    for argv, message in [(island, "cannot reach the coordinator at 127.0.0.1:9"), (evaluate, f"{s3}/missing")]:
        out = _run(argv)
        # The island's only other line says what it connects to.
        lines = [line for line in out.stderr.strip().splitlines() if "INFO islands.handshake: connecting to" not in line]
        assert out.returncode == 2 and len(lines) == 1, (argv, out.stderr[-2000:])
        assert message in lines[0], lines[0]
    out = _run(island + ["--log-level", "debug"])
    assert out.returncode == 2 and "botocore" in out.stderr


@pytest.mark.integration
@pytest.mark.parametrize("argv, message", [
    (["diloco-coordinator", "serve", "--shard", "1", "--shards", "2"], "needs --shard-addresses with 2 host:port entries"),
    (["diloco-coordinator", "serve", "--shard", "2", "--shards", "2", "--shard-addresses", "a:1,b:2"],
     "shard 2 does not exist in a coordinator of 2 shards"),
    (["diloco-coordinator", "serve", "--shard-addresses", "a:1,b:2"], "give --shard I, or run under torchrun"),
    (["diloco-coordinator", "serve", "--shard", "0", "--shards", "2", "--shard-addresses", "127.0.0.1:0,127.0.0.1:0"],
     "set DILOCO_SHARD_SECRET"),
    (["diloco-sim", "--coordinator-shards", "0"], "--coordinator-shards must be at least 1"),
    (["diloco-sim", "--coordinator-shards", "2", "--wan", "1gbit:10ms"], "does not combine with --wan"),
])
def test_bad_shard_flags_are_one_line_errors(argv, message):
    env = {k: v for k, v in os.environ.items() if k not in ("DILOCO_SHARD_SECRET", "RANK", "SLURM_PROCID")}
    out = subprocess.run(SCRIPTS[argv[0]] + argv[1:], capture_output=True, text=True, timeout=120, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert message in lines[0], lines[0]


def _serve(tmp_path, name: str, *flags: str) -> subprocess.Popen:
    """`diloco-coordinator serve` on a free loopback port, its spool in tmp_path (TMPDIR), once it serves."""
    import time

    port_file = tmp_path / f"{name}.port"
    with open(tmp_path / f"{name}.log", "w") as log:
        proc = subprocess.Popen(SCRIPTS["diloco-coordinator"] + ["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "-1",
                                "--port-file", str(port_file), *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 120
    while not (port_file.exists() and port_file.read_text()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not port_file.exists():
        proc.kill()
        proc.wait(30)
        pytest.fail((tmp_path / f"{name}.log").read_text()[-3000:])
    return proc


@pytest.mark.integration
def test_sigterm_stops_the_coordinator_as_ctrl_c_does(tmp_path):
    """What Kubernetes, systemd and SLURM send: the server stops, the report is written, the spool it made goes."""
    import json
    import signal

    report = tmp_path / "report.json"
    proc = _serve(tmp_path, "coordinator", "--report", str(report))
    try:
        assert len(list(tmp_path.glob("diloco-spool-*"))) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert json.loads(report.read_text())["rounds"] == []
    assert list(tmp_path.glob("diloco-spool-*")) == []


@pytest.mark.integration
def test_a_killed_coordinators_spool_goes_when_the_next_one_starts_and_a_live_ones_stays(tmp_path):
    """SIGKILL (or the OOM killer) leaves the spool directory, with whatever pushes waited on disk: the next coordinator
    on the machine removes it, and leaves the directory of one still serving alone."""
    import signal

    procs = [_serve(tmp_path, "live")]
    try:
        (live,) = tmp_path.glob("diloco-spool-*")
        procs.append(_serve(tmp_path, "killed"))
        (killed,) = set(tmp_path.glob("diloco-spool-*")) - {live}
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(30)
        (killed / "push-stand-in.spool").write_bytes(bytes(1 << 20))  # what a push waiting on disk leaves
        procs.append(_serve(tmp_path, "next"))
        now = set(tmp_path.glob("diloco-spool-*"))
        assert live in now and killed not in now and len(now) == 2, now
        assert f"removed {killed} (1.0 MB of pushes), left by a coordinator" in (tmp_path / "next.log").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    assert list(tmp_path.glob("diloco-spool-*")) == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


@pytest.mark.integration
def test_an_island_at_a_port_nobody_listens_on_says_what_it_waits_for_and_that_it_still_waits():
    # It printed nothing for the whole --connect-timeout (60 s), then a good error.
    address = f"127.0.0.1:{_free_port()}"
    with StderrLines(SCRIPTS["diloco-island"] + ["join", "--coordinator", address, "--device", "cpu",
                                                "--connect-timeout", "12"]) as island:
        island.wait_for(f"connecting to {address} (plaintext)")
        still = island.wait_for(f"still connecting to {address} (plaintext)")
        assert "of --connect-timeout 12s; last: Connection refused" in still, still
        error = island.wait_for("error:")
        assert island.exit_code() == 2
    assert error == (f"diloco-island: error: cannot reach the coordinator at {address} within 12s over plaintext (last: "
                     "Connection refused); check the address and that `diloco-coordinator serve` is running"), error


@pytest.mark.integration
def test_a_plaintext_island_facing_a_tls_coordinator_is_told_at_once_to_join_with_tls(tls_coordinator):
    # It printed nothing for 60 s, then "cannot reach".
    from conftest import tiny_config

    address = f"127.0.0.1:{tls_coordinator(tiny_config()).port}"
    out = _run(SCRIPTS["diloco-island"] + ["join", "--coordinator", address, "--device", "cpu",
                                          "--connect-timeout", "300"], timeout=240)
    assert out.returncode == 2, out.stderr
    assert f"connecting to {address} (plaintext)" in out.stderr
    assert _error_lines(out.stderr)[0] == (
        f"diloco-island: error: the coordinator at {address} serves mutual TLS and this island joins in plaintext: join "
        "with --tls DIR (the run's ca.pem and this island's certificate: `diloco-certs island DIR NAME`)")


@pytest.mark.integration
def test_an_island_says_whom_it_joined_what_it_fetches_and_that_it_waits_for_the_quorum(run_ca, tls_coordinator):
    # Its first line came after its first H inner steps. With robust.first_quorum 2 (the default) and one island, the
    # run's first round waits for a second island: the island says so, and again every 10 s.
    from conftest import tiny_config

    address = f"127.0.0.1:{tls_coordinator(tiny_config()).port}"
    with StderrLines(SCRIPTS["diloco-island"] + ["join", "--coordinator", address, "--device", "cpu", "--tls", str(run_ca),
                                                "--tls-name", "east"]) as island:
        island.wait_for(f"connecting to {address} (mutual TLS)")
        joined = island.wait_for(f"joined {address} as ")
        assert joined.endswith("at round 0, adopting its config " + tiny_config().digest() + " (no --config)"), joined
        island.wait_for(f"fetching the global parameters (")
        island.wait_for("waiting for round 0 to close at the coordinator")
        island.wait_for("still waiting for round 0 to close at the coordinator")
        text = island.text()
    order = [text.index(s) for s in ("connecting to", "joined", "fetching the global", "waiting for round 0",
                                     "still waiting for round 0")]
    assert order == sorted(order), text


@pytest.mark.integration
def test_serve_logs_each_rounds_losses_and_a_summary_at_the_end(tmp_path):
    # It showed only "initial eval loss" and "round N closed": nothing of whether the run learns.
    import re

    tiny = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32",
            "data.seq_len=32", "inner.batch_size=4", "inner.steps_per_round=2", "eval.batches=2", "rounds.rounds=3",
            "eval.every_rounds=2", "robust.first_quorum=1", "rounds.deadline_s=60"]
    proc = _serve(tmp_path, "coordinator", "--linger", "60", *(f for o in tiny for f in ("--set", o)))
    try:
        port = (tmp_path / "coordinator.port").read_text()
        island = _run(SCRIPTS["diloco-island"] + ["join", "--coordinator", f"127.0.0.1:{port}", "--device", "cpu"], timeout=300)
        assert island.returncode == 0, island.stderr[-3000:]
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    log = (tmp_path / "coordinator.log").read_text()
    loss = r"\d+\.\d{4}"
    closed = re.findall(rf"round (\d) closed \(.+\) with 1 islands: train loss {loss}(, eval loss {loss})?$", log, re.M)
    # Evaluated every 2 rounds (round 0, round 2) and at the end (round 2).
    assert [(r, bool(e)) for r, e in closed] == [("0", True), ("1", False), ("2", True)], log[-3000:]
    summary = re.search(rf"run finished: 3 rounds, eval loss ({loss}) -> ({loss}), ([\d,]+) tokens, traffic .+, "
                        r"checksum ([0-9a-f]+)$", log, re.M)
    assert summary, log[-3000:]
    assert int(summary[3].replace(",", "")) == 3 * 2 * 4 * 32  # rounds x H x batch x seq_len
    assert summary[4] in island.stderr  # the island's final checksum, the same parameters


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, reason: int = 0):
        self._code, self._details, self.refusal = code, details, pb.Refusal(reason=reason)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.unit
def test_an_island_ended_by_a_lost_coordinator_says_so_rather_than_that_it_was_refused():
    """A transport failure past the client's retries carries no refusal (the issue-42 team run's island said
    'coordinator refused: UNAVAILABLE: failed to connect'): it ends with a line saying the coordinator was lost and
    what to do, exit 1; a refusal keeps its words and exit 2; REPLACED its own status."""
    from islands.cli import ending
    from islands.outcome import REPLACED_EXIT

    message, status = ending(_Failed(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"))
    assert message.startswith("lost the coordinator (UNAVAILABLE: failed to connect") and "--resume" in message
    assert status == 1
    refused = _Failed(grpc.StatusCode.NOT_FOUND, "unknown island 'east'", Reason.NOT_A_MEMBER)
    assert ending(refused) == ("coordinator refused: NOT_FOUND: unknown island 'east'", 2)
    assert ending(_Failed(grpc.StatusCode.ALREADY_EXISTS, "another process", Reason.REPLACED))[1] == REPLACED_EXIT
