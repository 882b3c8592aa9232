"""Shared fixtures: a tiny run config and an in-process coordinator on 127.0.0.1; and the check that every test is
marked unit or integration. Helpers that are not fixtures and that several test modules share: tests/kit.py."""

from __future__ import annotations

import functools
import json
import logging
import os
import urllib.request
from contextlib import contextmanager
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from coordinator.server import start_coordinator
from diloco.config import load_config
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION

KINDS = ("unit", "integration")  # pyproject.toml's markers: `-m unit` and `-m integration` select each half


def pytest_collection_modifyitems(config, items):
    """Every test is marked unit or integration, exactly one of them (a module's pytestmark, the test's own mark, or
    a parameter's): a test marked neither or both stops the collection, so that a new test says which it is."""
    wrong = sorted({item.nodeid.split("[")[0] for item in items
                    if sum(item.get_closest_marker(kind) is not None for kind in KINDS) != 1})
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) marked neither or both of @pytest.mark.unit and @pytest.mark.integration (unit: in "
            "this process alone, no processes, gRPC servers or sockets, a fake clock; integration: everything else; "
            "a module of one kind says pytestmark = pytest.mark.unit or .integration):\n  " + "\n  ".join(wrong))


@contextmanager
def island_on(coordinator, cfg):
    """A one-rank CPU island joined to coordinator with cfg's codec; its client and world closed after."""
    from islands.client import CoordinatorClient
    from islands.island import Island
    from islands.world import IslandWorld

    from diloco.wire.messages import uplink_codec

    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    try:
        yield Island(cfg, world, client, client.join(cfg.digest(), uplink_codec(cfg.wire).name))
    finally:
        client.close()
        world.shutdown()


def tiny_config(*overrides: str):
    """A model small enough that a round takes milliseconds; every other setting is the default users get (the claim
    check and the norm guard included): a test that must turn one off says why where it does."""
    base = [
        "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32",
        "data.seq_len=32", "inner.batch_size=4", "inner.steps_per_round=2",
        # No held-out evaluation at each close (the tests that need it ask for eval.batches); a failed test ends in
        # 30 s rather than at the default deadline; small chunks so that even this model spans several.
        "eval.batches=0",
        "rounds.deadline_s=30", "wire.chunk_bytes=4096",
    ]
    return load_config(None, base + list(overrides))


def one_island_config(*overrides: str):
    """tiny_config for a run of one island: robust.first_quorum 1, as diloco-sim sets for one island. With the default
    2 the run's first outer step waits for a second island to judge the first against (diloco/robust.py); a test whose
    subject is something else and that runs one island has no second."""
    return tiny_config("robust.first_quorum=1", *overrides)


def per_step(cfg) -> int:
    """The tokens one rank trains in one inner step: inner.batch_size x data.seq_len (128 in tiny_config)."""
    return cfg.inner.batch_size * cfg.data.seq_len


def claim(cfg, steps: int = 1, ranks: int = 1) -> dict:
    """An honest push claim for a PushHeader: `steps` inner steps on `ranks` ranks (the island must have joined
    declaring at least that many), as pb.PushHeader(..., **claim(cfg, 2)). The coordinator's claim check
    (robust.check_claims, on by default) refuses more tokens than that, or steps beyond a round's."""
    return {"tokens": steps * ranks * per_step(cfg), "inner_steps": steps}


def trained_from(coordinator, round_: int | None = None, fragment: int = 0) -> str:
    """The global_checksum of an honest push for round_ (None: the fragment's current round) to a Coordinator or a
    CoordinatorState: the checksum of the parameters that round started from. A push naming none is refused."""
    f = getattr(coordinator, "state", coordinator).fragments[fragment]
    return f.checksum if round_ is None or f.late is None else f.late.published.get(round_, f.checksum)


PER_STEP = per_step(tiny_config())  # 4 x 32 = 128 tokens a rank trains per inner step in tiny_config


@pytest.fixture
def s3(monkeypatch):
    """A local S3-compatible server (moto) with a bucket; yields the bucket's s3:// URL prefix."""
    moto_server = pytest.importorskip("moto.server")
    import boto3
    import s3fs

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in {
            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        }.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still point at an old server
        # moto keeps its buckets in process-wide memory: start every test from an empty store.
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=10)
        boto3.client("s3").create_bucket(Bucket="diloco-test")
        yield "s3://diloco-test"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture
def make_coordinator(tmp_path):
    """Starts coordinators on 127.0.0.1 and stops every one of them after the test."""
    started = []

    def make(cfg):
        c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / f"spool{len(started)}"))
        started.append(c)
        return c

    yield make
    for c in started:
        c.stop(0.5)


@pytest.fixture
def run_ca(tmp_path) -> Path:
    """A run's CA and certificates: the coordinator's for 127.0.0.1; one-rank islands east, west and mallory (the
    attacker's: a valid key); a two-rank (FSDP) island, sharded; and legacy, issued before certificates carried ranks."""
    from diloco.security import credentials

    d = tmp_path / "tls"
    credentials.create_ca(d)
    credentials.issue_coordinator(d, ["127.0.0.1"])
    for name in ("east", "west", "mallory"):
        credentials.issue_island(d, name)
    credentials.issue_island(d, "sharded", ranks=2)
    credentials.issue_island(d, "legacy", ranks=None)
    return d


@pytest.fixture
def tls_coordinator(run_ca, tmp_path):
    """Starts coordinators with mutual TLS (run_ca's certificates, its revoked.json re-read at every check) on
    127.0.0.1, and stops every one of them after the test."""
    from diloco.security import credentials

    started = []

    def start(cfg, audit_url: str = ""):
        c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / f"tls-spool{len(started)}"),
                              tls=credentials.coordinator_files(run_ca),
                              revocations=credentials.RevocationList(run_ca / "revoked.json", check_interval_s=0.0),
                              audit_url=audit_url)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop(0.5)


@pytest.fixture
def channel_to():
    channels = []

    def make(coordinator):
        ch = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
        channels.append(ch)
        return pb_grpc.CoordinatorStub(ch)

    yield make
    for ch in channels:
        ch.close()


def join(stub, digest: str = "") -> pb.JoinResponse:
    return stub.Join(pb.JoinRequest(config_digest=digest, hostname="test", protocol_version=PROTOCOL_VERSION), timeout=10)


def ended(messages) -> Iterator[pb.PushMessage]:
    """A push stream as islands send it: the messages, then the PushEnd counting their chunks."""
    n = 0
    for message in messages:
        n += message.HasField("chunk")
        yield message
    yield pb.PushMessage(end=pb.PushEnd(chunks=n))


def random_like(shapes, seed: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def wait_for_round(coordinator, round_: int, timeout_s: float = 10.0) -> None:
    """Blocks until the coordinator has moved past round_ and recorded its summary."""
    state = coordinator.state

    def closed() -> bool:
        return state.round > round_ and any(s.round == round_ and s.fragment == 0 for s in state.summaries)

    with state.cond:
        assert state.cond.wait_for(closed, timeout_s), f"round {round_} did not close"


ROOT = Path(__file__).resolve().parents[1]


# Brings `lo` up inside a fresh network namespace, like `ip link set lo up`, without needing iproute2
# (SIOCGIFFLAGS / SIOCSIFFLAGS on a struct ifreq: 16-byte name, short flags, padding to 40 bytes).
LO_UP = (
    "import fcntl, socket, struct; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "f = struct.unpack_from('16sH', fcntl.ioctl(s, 0x8913, struct.pack('16sH22x', b'lo', 0)))[1]; "
    "fcntl.ioctl(s, 0x8914, struct.pack('16sH22x', b'lo', f | 1))"
)
LO_UP_CMD = f"{shlex.quote(sys.executable)} -c {shlex.quote(LO_UP)}"


# User, network and PID namespaces: only loopback to bind, and when the scenario (PID 1 there) ends or
# is killed (--kill-child), the kernel kills every process it started, torchrun's workers included.
NAMESPACE = ["unshare", "-rn", "--pid", "--fork", "--mount-proc", "--kill-child"]


@functools.cache
def loopback_namespace() -> bool:
    """Whether `unshare` gives us user, network and PID namespaces here."""
    try:
        return subprocess.run([*NAMESPACE, "sh", "-c", LO_UP_CMD], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_scenario(script: str, name: str, workdir: Path, timeout_s: float, *args: str) -> dict:
    """Runs tests/<script> <name> <workdir> in a network namespace with only loopback; returns its result.json.

    torchft's Manager and checkpoint server bind every interface: the namespace keeps them on lo.
    """
    if not loopback_namespace():
        pytest.skip("needs `unshare -rn --pid` (user, network and PID namespaces) to keep torchft's servers on a "
                    "loopback-only network and reap every process a scenario starts")
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = f"{LO_UP_CMD} && exec {sys.executable} tests/{script} {name} {workdir} {' '.join(args)}"
    try:
        proc = subprocess.run([*NAMESPACE, "sh", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scenario {name} outlived {timeout_s:.0f}s; logs in {workdir}")
    assert proc.returncode == 0, f"scenario {name} failed (logs in {workdir}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads((workdir / "result.json").read_text())


def kill_all_and_resume(sim, step: int, islands: int, timeout_s: float) -> None:
    """Once the coordinator and every island committed checkpoint `step`, SIGKILLs them all and restarts them with --resume."""
    ckpt = sim.workdir / "ckpt"
    owners = ["coordinator", *(f"island-{i}" for i in range(islands))]
    deadline = time.monotonic() + timeout_s
    while not all((ckpt / d / f"step-{step:010d}" / "COMMITTED").exists() for d in owners):
        assert time.monotonic() < deadline, f"checkpoints of step {step} never appeared"
        time.sleep(0.02)
    sim.kill_coordinator()
    for i in range(islands):
        sim.kill_island(i)
    sim.start_coordinator(resume=True)
    for i in range(islands):
        sim.start_island(i, resume=True)


def straight_and_resumed(cfg, islands: int, workdir: Path, step: int = 2, timeout_s: float = 300):
    """The same run twice: straight through, and with every process SIGKILLed once checkpoint `step`
    is in, then resumed. Returns both SimResults."""
    from islands.sim.simulation import Simulation, run_sim

    straight = run_sim(cfg, islands, workdir / "straight", timeout_s=timeout_s, echo=lambda s: None)
    sim = Simulation(cfg, islands, workdir / "stopped", checkpoints=True)
    try:
        sim.start()
        kill_all_and_resume(sim, step=step, islands=islands, timeout_s=120)
        for _ in sim.watch(timeout_s):
            pass
        return straight, sim.finish(timeout_s)
    finally:
        sim.close()


def _gloo_rank(rank: int, body, world_size: int, workdir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    try:
        body(rank, world_size, workdir)
    finally:
        dist.destroy_process_group()
    # The rank's work is done and written: skip the interpreter's teardown, where gloo's threads can abort the
    # process ("terminate called without an active exception", pytorch/pytorch#179291; as islands/cli.py does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo_ranks(body, world_size: int, workdir: Path, monkeypatch) -> None:
    """Runs body(rank, world_size, workdir) on world_size spawned processes joined in one gloo group over loopback."""
    import torch.multiprocessing as mp

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the spawned ranks inherit it
    mp.start_processes(_gloo_rank, args=(body, world_size, str(workdir)), nprocs=world_size, start_method="spawn")
