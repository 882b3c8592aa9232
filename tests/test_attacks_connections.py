"""One stolen island key (or none at all) must not wreck a run: what a caller may hold of the coordinator's
connections, spool and TLS, and of an island's /metrics server, is bounded, and honest rounds keep closing.

Each test plays the attacker beside honest islands and asserts the refusal or the bound. The machine these run
on is busy: every wait has a generous bound, and each test says what it measured.
"""

from __future__ import annotations

import json
import os
import re
import resource
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
import warnings
from pathlib import Path

import grpc
import pytest
import torch

from conftest import ROOT, claim, one_island_config, tiny_config, trained_from, wait_for_round
from coordinator.server import HANDSHAKE_TIMEOUT_S, initial_parameters, start_coordinator
from coordinator.spool import FLOOR_PUSHES, record_bytes
from coordinator.web import RunWebServer
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks, uplink_codec
from islands import telemetry
from islands.telemetry import MetricsServer



def _join(stub, **fields) -> str:
    return stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, **fields), timeout=30).island_id


# --- item 8: idle connections from anyone who reaches the port ------------------------------------------------


class Flood:
    """`n` TCP connections to a port that never send a byte, kept at n from a thread of their own: one closed by
    the server is counted with how long it lived, and replaced. Nothing here has a certificate."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.lifetimes: list[float] = []  # seconds from connect to the server's close, per closed connection
        self.failed_connects = 0
        self._open: dict[socket.socket, float] = {}
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self._fill()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        for s in list(self._open):
            self._forget(s)
        self._selector.close()

    def _fill(self) -> None:
        while len(self._open) < self.n and not self._stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            except OSError:
                self.failed_connects += 1
                return
            s.setblocking(False)
            self._open[s] = time.monotonic()
            self._selector.register(s, selectors.EVENT_READ)

    def _forget(self, s: socket.socket) -> None:
        self._selector.unregister(s)
        del self._open[s]
        s.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.2):
                s = key.fileobj
                try:
                    closed = s.recv(1) == b""
                except (BlockingIOError, InterruptedError):
                    closed = False
                except OSError:  # reset by the server
                    closed = True
                if closed:
                    self.lifetimes.append(time.monotonic() - self._open[s])
                    self._forget(s)
            self._fill()


def _soft_nofile_of(pid: int) -> int:
    match = re.search(r"Max open files\s+(\d+)", Path(f"/proc/{pid}/limits").read_text())
    assert match, "no open-file limit in /proc"
    return int(match.group(1))


def _honest_round(stubs: dict[str, pb_grpc.CoordinatorStub], ids: dict[str, str], cfg, round_: int, checksum: str) -> str:
    """Both islands push zeros for round_ (trained from checksum); returns the checksum of the round's result."""
    codec = uplink_codec(cfg.wire)
    zeros = {n: torch.zeros_like(t) for n, t in initial_parameters(cfg).items()}
    for name, stub in stubs.items():
        header = pb.PushHeader(island_id=ids[name], round=round_, codec=codec.name, global_checksum=checksum, **claim(cfg))
        assert stub.PushPseudoGradient(push_messages(header, tensor_chunks(zeros, codec, cfg.wire.chunk_bytes)),
                                       timeout=120).accepted
    result = list(stubs["east"].PullRoundResult(pb.PullRequest(island_id=ids["east"], round=round_, timeout_s=60), timeout=120))
    assert result[0].header.round == round_ + 1
    return result[0].header.checksum


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/limits").exists(), reason="reads the coordinator's open-file limit in /proc (Linux)")
def test_idle_connections_without_a_certificate_are_closed_and_rounds_go_on(run_ca, tmp_path):
    """400 TCP connections that never handshake, to a coordinator started with a soft limit of 256 open files,
    held at 400 for as long as two islands train: each is closed about HANDSHAKE_TIMEOUT_S after it opened (gRPC's
    default held them 120 s, and 1,100 took every file of a 1,024 limit: 0 rounds in 30 s), the coordinator raised
    its own limit at start, and the islands, connecting in the middle of the flood, join and close rounds."""
    flood_n, started_soft = 400, 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = flood_n + 400  # the flood's sockets, gRPC's and torch's files in this process
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"needs {wanted} open files; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    cfg = tiny_config("rounds.rounds=1000", "rounds.min_islands=2", "rounds.lease_s=600", "rounds.deadline_s=120")
    config_path, port_file = tmp_path / "run.toml", tmp_path / "port"
    config_path.write_text(cfg.to_toml())
    cmd = [sys.executable, "-m", "coordinator", "serve", "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
           "--tls", str(run_ca), "--http-port", "-1", "--config", str(config_path), "--linger", "0"]
    log = open(tmp_path / "coordinator.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp_path)},
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (started_soft, hard)))
    channels: list[grpc.Channel] = []
    try:
        deadline = time.monotonic() + 180
        while not (port_file.exists() and port_file.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert port_file.exists(), f"the coordinator did not start: {(tmp_path / 'coordinator.log').read_text()[-3000:]}"
        port = int(port_file.read_text())
        assert _soft_nofile_of(proc.pid) == hard, "the coordinator did not raise its soft limit on open files"
        rounds, began = 0, time.monotonic()
        with Flood(port, flood_n) as flood:
            stubs, ids = {}, {}
            for name in ("east", "west"):  # new clients, in the middle of the flood
                ca, cert, key = credentials.island_files(run_ca, name).read()
                channels.append(grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert)))
                stubs[name] = pb_grpc.CoordinatorStub(channels[-1])
                ids[name] = _join(stubs[name])
            fetched = list(stubs["east"].FetchParameters(pb.FetchRequest(island_id=ids["east"]), timeout=120))
            checksum = fetched[0].header.checksum
            # Rounds for at least three handshake limits: the flood's first connections are closed and replaced meanwhile.
            while rounds < 3 or time.monotonic() - began < 3 * HANDSHAKE_TIMEOUT_S:
                assert time.monotonic() - began < 300, f"{rounds} rounds closed in 300 s of flood"
                checksum = _honest_round(stubs, ids, cfg, rounds, checksum)
                rounds += 1
                time.sleep(0.25)  # a round takes milliseconds: a few a second keep the run far from its last round
            held_s = time.monotonic() - began
        print(f"{rounds} rounds closed in {held_s:.0f} s with {flood_n} idle connections held; {len(flood.lifetimes)} of them "
              f"closed by the coordinator after {min(flood.lifetimes):.1f}..{max(flood.lifetimes):.1f} s; "
              f"{flood.failed_connects} connects failed")
        assert len(flood.lifetimes) >= flood_n, "the coordinator kept connections that never handshook"
        # Closed at the limit, not at gRPC's 120 s; what is above it is the busy machine.
        assert HANDSHAKE_TIMEOUT_S - 1 <= min(flood.lifetimes) and max(flood.lifetimes) < HANDSHAKE_TIMEOUT_S + 25
    finally:
        for ch in channels:
            ch.close()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        log.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- item 9: the spool, per island ------------------------------------------------------------------------------


def thread_stacks() -> str:
    """Each thread's innermost frames, a line each: what a test that waited in vain was waiting on."""
    frames = sys._current_frames()
    lines = []
    for thread in threading.enumerate():
        if (frame := frames.get(thread.ident)) is not None:
            inner = reversed(traceback.extract_stack(frame)[-4:])
            lines.append(f"{thread.name}: " + " < ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})" for f in inner))
    return "\n".join(lines)


@pytest.mark.integration
def test_a_member_that_never_finishes_its_pushes_fills_only_its_share_of_the_spool(make_coordinator, channel_to):
    """The attacker (a member declaring 8 ranks: 18 push streams) opens 12 streams that each send a whole model's
    chunks and never end. With one pool for everyone they took all of limits.spool_gb and every honest push was
    refused SPOOL_FULL; now it fills its share (the spool over the 3 members) and is refused, while 2 honest islands
    push and rounds close."""
    # A spool of 600 KB (about 12 pushes of this model): the attacker reaches the bound in a few chunks rather than
    # after 64 GB, and the bound still holds the honest islands' pushes and the attacker's share together.
    cfg = tiny_config("limits.spool_gb=0.0006", "rounds.rounds=50", "rounds.min_islands=2", "rounds.deadline_s=2",
                      "rounds.lease_s=600", "limits.push_idle_s=600",
                      "limits.idle_rounds=0")  # the attacker, which never contributes, stays a member throughout
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    east, west = _join(stub, island_key="east"), _join(stub, island_key="west")
    mallory = _join(stub, island_key="mallory", ranks=8)
    shapes = coordinator.state.manifest.shapes
    numel = coordinator.state.manifest.total_numel()
    spools = coordinator.state.fragments[0].ctx.spools
    share = spools.share(mallory, numel, 3)
    assert share.bytes == max(spools.max_bytes // 3, FLOOR_PUSHES * 5 * numel) < spools.max_bytes
    release = threading.Event()

    def never_ends(seed: int):
        g = torch.Generator().manual_seed(seed)
        pg = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
        yield pb.PushMessage(header=pb.PushHeader(island_id=mallory, round=0, codec="fp32", global_checksum=trained_from(coordinator),
                                                  **claim(cfg)))
        for chunk in tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes):
            yield pb.PushMessage(chunk=chunk)
        release.wait(300)

    attack = [stub.PushPseudoGradient.future(never_ends(i), timeout=300) for i in range(12)]

    def refused() -> list:
        return [f for f in attack if f.done() and reason_of(f.exception()) == Reason.SPOOL_FULL]

    # What one whole attack stream holds in the spool (coordinator/spool.py Spool.write: a record per chunk).
    whole = sum(record_bytes(c.name.encode(), len(c.payload)) for c in tensor_chunks(
        {n: torch.zeros(s) for n, s in shapes.items()}, Fp32Codec(), cfg.wire.chunk_bytes))

    def settled() -> bool:
        """Every stream refused or held whole. Not "held near its share": streams refused at once each give back
        what they held, so how many stay whole depends on the interleaving (2 or 3 of them here)."""
        held = spools.held.get(mallory, 0)
        return bool(refused()) and held % whole == 0 and len(refused()) + held // whole == len(attack)

    try:
        deadline = time.monotonic() + 120
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert refused(), f"the attacker holds {spools.held.get(mallory, 0)} bytes, its share {share.bytes}, and no stream was refused"
        if not settled():
            # A stream was seen to stop part way in CI (the share held all the same), for a cause not known yet: what
            # the threads were doing goes in the warnings.
            warnings.warn(f"the attack did not settle in 120 s: {spools.held.get(mallory, 0)} bytes held ({whole} a whole "
                          f"stream), {len(refused())} of {len(attack)} streams refused, push slots "
                          f"{coordinator.state.push_slots.status()}; threads:\n{thread_stacks()}")
        closed_before = len(coordinator.state.summaries)
        for round_ in range(3):
            for i, island in enumerate((east, west)):
                g = torch.Generator().manual_seed(100 * round_ + i)
                pg = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
                header = pb.PushHeader(island_id=island, round=round_, codec="fp32", global_checksum=trained_from(coordinator),
                                       **claim(cfg))
                reply = stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)),
                                                timeout=120)
                assert reply.contribution_complete
            wait_for_round(coordinator, round_, timeout_s=120)
        held, failed = spools.held.get(mallory, 0), refused()
        print(f"attacker: {len(failed)} of 12 streams refused SPOOL_FULL, {held} bytes held of its share {share.bytes} "
              f"(the spool {spools.max_bytes}); honest: 6 pushes, 3 rounds closed")
        assert held <= share.bytes  # settled, the streams not refused are whole: as many as the share holds
        assert len(coordinator.state.summaries) - closed_before == 3
        assert all(sorted(s.islands) == sorted([east, west]) for s in coordinator.state.summaries[-3:])
        assert "its share" in failed[0].exception().details()
    finally:
        release.set()
        for f in attack:
            f.cancel()
    deadline = time.monotonic() + 60  # the cut streams give back what they held
    while spools.held.get(mallory, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not spools.held.get(mallory, 0)


@pytest.mark.unit
def test_an_island_takes_at_most_its_share_of_the_memory_pool(tmp_path):
    """Blocks of the memory pool per island: the rest of a greedy island's pushes wait on disk, the others' in memory."""
    from coordinator.spool import BLOCK_PAYLOAD, Spools

    spools = Spools(tmp_path, max_bytes=1 << 30, memory_bytes=4 * BLOCK_PAYLOAD, chunk_bytes=1 << 20)
    payload = bytes(1 << 20)
    greedy = [spools.open(1 << 40, "greedy", members=2) for _ in range(3)]
    for spool in greedy:
        for i in range(8):  # a block's worth each
            spool.write("w", i, 1, 0, payload)
    assert spools.blocks_held["greedy"] == 2 and greedy[2].path is not None  # the third went to disk
    honest = spools.open(1 << 40, "honest", members=2)
    honest.write("w", 0, 1, 0, payload)
    assert honest.path is None and spools.blocks_held["honest"] == 1
    for spool in (*greedy, honest):
        spool.discard()
    assert not spools.blocks_held and not spools.held and spools.used == 0


# --- item 11 ----------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_coordinator_speaks_tls_1_3_and_the_readme_says_it_also_accepts_1_2(run_ca, tmp_path):
    """grpcio 1.85 gives a Python server no minimum TLS version (ssl_server_credentials has no such argument, and
    GRPC_SSL_CIPHER_SUITES without a TLS 1.2 suite makes the port fail to bind): a client offering TLS 1.3 gets it, one
    offering only TLS 1.2 is served with it, and the README says so rather than "TLS 1.3"."""
    coordinator = start_coordinator(tiny_config(), "127.0.0.1", 0, spool_dir=str(tmp_path / "spool"),
                                    tls=credentials.coordinator_files(run_ca))
    try:
        files = credentials.island_files(run_ca, "east")
        negotiated = {}
        for most in (ssl.TLSVersion.TLSv1_3, ssl.TLSVersion.TLSv1_2):
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(files.ca)
            context.load_cert_chain(files.cert, files.key)
            context.maximum_version = most
            context.set_alpn_protocols(["h2"])
            with socket.create_connection(("127.0.0.1", coordinator.port), timeout=30) as raw:
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                    negotiated[most.name] = tls.version()
    finally:
        coordinator.stop(0.5)
    print(f"negotiated: {negotiated}")
    assert negotiated == {"TLSv1_3": "TLSv1.3", "TLSv1_2": "TLSv1.2"}
    readme = (ROOT / "README.md").read_text()
    assert "also accepts a client that offers only TLS 1.2" in readme


@pytest.mark.integration
def test_a_push_that_names_no_global_checksum_is_refused(make_coordinator, channel_to):
    """An empty global_checksum skipped the check that a push was trained from the coordinator's parameters."""
    cfg = one_island_config()
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    island = _join(stub)
    pg = {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}
    header = pb.PushHeader(island_id=island, round=0, codec="fp32", **claim(cfg))
    with pytest.raises(grpc.RpcError) as e:
        stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)), timeout=30)
    assert reason_of(e.value) == Reason.BAD_REQUEST and "global_checksum" in e.value.details()
    assert island not in coordinator.state.fragments[0].contributions
    header.global_checksum = trained_from(coordinator)
    reply = stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)), timeout=30)
    assert reply.contribution_complete


def _closed_by_peer(s: socket.socket, deadline: float) -> bool:
    """Reads what the server sends until it closes the connection (True), or until the deadline (False)."""
    while True:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            if not s.recv(4096):
                return True
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False


def _half_sent(port: int, n: int) -> list[socket.socket]:
    """n connections that send a request's first lines and never the blank line that ends its headers."""
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: island\r\n")
        held.append(s)
    return held


@pytest.mark.integration
def test_half_sent_metrics_requests_hold_no_thread_and_a_scrape_among_them_is_answered(monkeypatch):
    """300 requests that send their first lines and stop held 300 threads of the island for as long as their clients
    liked; bounded at METRICS_HANDLERS threads, they then made the port drop a scrape (RemoteDisconnected in 1 ms).
    Now the port is served as the coordinator's (diloco/security/httpserve.py): they hold no thread, a scrape among them is
    answered, and each is closed METRICS_TIMEOUT_S after it opened."""
    monkeypatch.setattr(telemetry, "METRICS_TIMEOUT_S", 5.0)  # the bound, shortened for the test
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("probe", "a probe", registry=registry).inc()
    server = MetricsServer(registry, "127.0.0.1", 0)
    before = threading.active_count()
    held: list[socket.socket] = []
    try:
        held = _half_sent(server.port, 300)
        began = time.monotonic()
        with urllib.request.urlopen(server.url, timeout=30) as reply:  # while all 300 are open
            assert b"probe_total 1.0" in reply.read()
        answered_s = time.monotonic() - began
        threads = threading.active_count() - before
        deadline = time.monotonic() + 120
        closed = sum(_closed_by_peer(s, deadline) for s in held)  # every one, by the server
        print(f"300 half-sent requests: a scrape answered in {answered_s * 1000:.0f} ms among them, {threads} threads "
              f"more than before, {closed} connections closed by the server")
        assert threads <= 0 and closed == 300
        with urllib.request.urlopen(server.url, timeout=30) as reply:  # and it serves on
            assert b"probe_total 1.0" in reply.read()
    finally:
        for s in held:
            s.close()
        server.stop()


@pytest.mark.integration
def test_half_sent_requests_to_the_coordinators_dashboard_hold_no_thread_either(make_coordinator):
    """The dashboard's port is the same server: a thread per connection was 300 threads for 30 s each."""
    coordinator = make_coordinator(one_island_config())
    with RunWebServer(coordinator.state, metrics=lambda: (b"probe_total 1.0\n", "text/plain")) as web:
        before = threading.active_count()
        held = _half_sent(web.port, 300)
        try:
            with urllib.request.urlopen(f"{web.url}metrics", timeout=30) as reply:
                assert reply.read() == b"probe_total 1.0\n"
            with urllib.request.urlopen(f"{web.url}api/run", timeout=30) as reply:
                assert json.loads(reply.read())
            assert threading.active_count() - before <= 0
        finally:
            for s in held:
                s.close()
