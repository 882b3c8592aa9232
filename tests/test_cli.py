"""The console scripts: --help, and one-line errors with exit status 2 for bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPTS = {
    "diloco-coordinator": [sys.executable, "-m", "coordinator"],
    "diloco-island": [sys.executable, "-m", "islands"],
    "diloco-sim": [sys.executable, "-m", "islands.sim"],
}


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
        (["diloco-sim", "--islands", "zero"], "invalid int value: 'zero'"),
        (["diloco-sim", "--config", "/nonexistent.toml"], "config file not found"),
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
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    from diloco.wire.messages import PROTOCOL_VERSION

    expected = f"protocol version {PROTOCOL_VERSION - 1} is not {PROTOCOL_VERSION}"
    assert "PROTOCOL_MISMATCH" in lines[0] and expected in lines[0], lines[0]


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
        lines = out.stderr.strip().splitlines()
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
