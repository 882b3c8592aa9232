"""A stolen island key must not wreck a run through its reads: a stalled fetch or pull, overlapping ranges, held watches.

The attacker ("mallory") holds a valid island certificate of the run's CA and talks to the coordinator with the
generated stubs, as anyone with the .proto can. Its channel turns HTTP/2's window probing off, so that a call it
stops reading stops the coordinator's sends after a few chunks (a slow link does the same to an honest island).
Two honest islands ("east", "west") push and pull rounds meanwhile; every test asserts that rounds keep closing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import claim, tiny_config
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.params import ranges_checksum
from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, Manifest, push_messages, tensor_chunks

pytestmark = pytest.mark.integration

# ~135k parameters (540 KB of values): far more than a stalled reader's window takes, and rounds still take milliseconds.
SMALL = ("model.d_model=64", "model.n_layers=2", "model.d_ff=256", "model.n_heads=2", "rounds.rounds=100000",
         "rounds.lease_s=600")



@pytest.fixture
def coordinator(tls_coordinator):
    """Starts a coordinator of the SMALL model with mutual TLS (conftest's tls_coordinator)."""
    return lambda *overrides: tls_coordinator(tiny_config(*SMALL, *overrides))


@pytest.fixture
def channels(run_ca):
    """Opens channels as a credential (mallory's never probes for a bigger window) and closes them after the test."""
    opened = []

    def open_as(coordinator, name: str) -> grpc.Channel:
        ca, cert, key = credentials.island_files(run_ca, name).read()
        options = [("grpc.http2.bdp_probe", 0)] if name == "mallory" else []
        channel = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert), options=options)
        opened.append(channel)
        return channel

    yield open_as
    for channel in opened:
        channel.close()


class Member:
    """An island speaking the protocol by hand: joins, then each round pushes a small random pseudo-gradient trained
    from the parameters it holds and pulls the result. stall: it reads only each pull's header and never the rest
    (the calls are kept open in `held`)."""

    def __init__(self, channel: grpc.Channel, cfg, stall: bool = False):
        self.channel, self.stub, self.cfg, self.stall = channel, pb_grpc.CoordinatorStub(channel), cfg, stall
        self.held: list = []
        joined = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=60)
        self.island_id, self.shapes = joined.island_id, Manifest.from_proto(joined.parameters).shapes
        header = next(self.stub.FetchParameters(pb.FetchRequest(island_id=self.island_id), timeout=120)).header
        self.round, self.checksum = header.round, header.checksum

    def push(self) -> None:
        pg = {n: torch.randn(s) * 1e-3 for n, s in self.shapes.items()}
        header = pb.PushHeader(island_id=self.island_id, round=self.round, codec="fp32", global_checksum=self.checksum,
                               **claim(self.cfg))
        self.stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), self.cfg.wire.chunk_bytes)), timeout=120)

    def pull(self, timeout_s: float = 60) -> pb.ResultHeader:
        call = self.stub.PullRoundResult(pb.PullRequest(island_id=self.island_id, round=self.round, timeout_s=timeout_s),
                                         timeout=timeout_s + 60)
        if self.stall:
            self.held.append(call)
            return next(call).header
        return list(call)[0].header

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.push()
                header = self.pull()
            except (grpc.RpcError, ValueError):  # ValueError: its channel closed, at the end
                if stop.is_set():
                    return
                time.sleep(0.2)  # refused (a round that moved on): the next round
                continue
            self.round, self.checksum = header.round, header.checksum


@contextmanager
def members(*islands: Member) -> Iterator[None]:
    stop = threading.Event()
    threads = [threading.Thread(target=m.run, args=(stop,), daemon=True) for m in islands]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for m in islands:
            m.channel.close()  # ends the calls in flight
        for t in threads:
            t.join(30)


def rounds_close(coordinator, n: int, timeout_s: float = 60.0) -> int:
    """Waits for n more rounds to close; returns how many did within timeout_s."""
    state = coordinator.state
    with state.cond:
        start = state.round
        state.cond.wait_for(lambda: state.round >= start + n, timeout_s)
        return state.round - start


@pytest.mark.parametrize("downlink", ["", "e3m0"])  # e3m0: the values are framed from a file-backed published copy
def test_a_fetch_that_reads_one_message_and_stalls_holds_up_no_round(coordinator, channels, downlink):
    c = coordinator(f"wire.downlink_codec='{downlink}'")
    assert c.state.publication.lossless == (not downlink)
    cfg = c.state.cfg
    stalled = pb_grpc.CoordinatorStub(channels(c, "mallory")).FetchParameters(pb.FetchRequest(), timeout=600)  # an observer: no island id
    assert next(stalled).HasField("header")  # and nothing more is read: the coordinator's sends stop after a few chunks
    with members(Member(channels(c, "east"), cfg), Member(channels(c, "west"), cfg)):
        assert rounds_close(c, 3) == 3  # it froze the run: 0 rounds in 30 s (the step waited for the reader's lock)
        # Its values were superseded twice by now: dropped, and its call cut off, which frees their memory and its
        # thread. Reading on, it gets what its window held, then the end: never the rest of the model.
        with pytest.raises(grpc.RpcError) as e:
            list(stalled)
        assert e.value.code() == grpc.StatusCode.CANCELLED or reason_of(e.value) == Reason.ROUND_CLOSED
        assert rounds_close(c, 2) == 2


def test_a_member_whose_pulls_stall_after_their_header_holds_up_no_round(coordinator, channels):
    c = coordinator()
    cfg = c.state.cfg
    mallory = Member(channels(c, "mallory"), cfg, stall=True)  # pushes every round like anyone; reads no result whole
    with members(mallory, Member(channels(c, "east"), cfg), Member(channels(c, "west"), cfg)):
        deadline = time.monotonic() + 60
        while not mallory.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mallory.held
        assert rounds_close(c, 3) == 3
        assert 3 in {len(s.islands) for s in c.state.summaries}  # its pushes were folded too: it is a member in good standing


def _ranges(*ranges: tuple[str, int, int]) -> list[pb.TensorRange]:
    return [pb.TensorRange(name=n, offset=o, numel=k) for n, o, k in ranges]


def test_overlapping_ranges_and_more_than_the_model_are_refused(coordinator, channels):
    c = coordinator("rounds.min_islands=1", "robust.first_quorum=1")  # one member pushes: its first outer step alone
    mallory_channel = channels(c, "mallory")
    mallory = pb_grpc.CoordinatorStub(mallory_channel)
    name, numel = max(((n, s.numel()) for n, s in c.state.params.items()), key=lambda p: p[1])
    whole = c.state.manifest.total_numel()
    bad = {
        "the same range twice": _ranges((name, 0, 100), (name, 0, 100)),
        "overlapping": _ranges((name, 0, 100), (name, 50, 100)),
        "an empty range twice": _ranges((name, 7, 0), (name, 7, 0)),
        # A 141 KiB request once asked for 168 MiB: the whole tensor over and over.
        "the tensor 50 times": _ranges(*[(name, 0, numel)] * 50),
    }
    for what, ranges in bad.items():
        with pytest.raises(grpc.RpcError) as e:
            list(mallory.FetchParameters(pb.FetchRequest(ranges=ranges), timeout=30))
        assert reason_of(e.value) == Reason.BAD_REQUEST, what
    assert whole < 50 * numel
    # Disjoint ranges of one tensor are fine: exactly their elements, cut out of the shared value messages.
    wanted = [(name, 10, 1500), (name, 3000, 37)]
    messages = list(mallory.FetchParameters(pb.FetchRequest(ranges=_ranges(*wanted)), timeout=30))
    got: dict[int, float] = {}
    for m in messages[1:]:
        values = torch.frombuffer(bytearray(m.chunk.payload), dtype=torch.float32)
        got.update({m.chunk.offset + i: v for i, v in enumerate(values.tolist())})
    flat = c.state.params[name].view(-1)
    assert got == {i: flat[i].item() for _, o, k in wanted for i in range(o, o + k)}
    assert messages[0].header.ranges_checksum == ranges_checksum((n, o, flat[o : o + k]) for n, o, k in wanted)
    member = Member(mallory_channel, c.state.cfg)
    member.push()
    with pytest.raises(grpc.RpcError) as e:
        list(mallory.PullRoundResult(pb.PullRequest(island_id=member.island_id, round=member.round, timeout_s=30,
                                                    ranges=bad["overlapping"]), timeout=60))
    assert reason_of(e.value) == Reason.BAD_REQUEST


def test_held_watches_are_bounded_per_credential_and_rounds_keep_closing(coordinator, channels, run_ca):
    c = coordinator()
    cfg = c.state.cfg
    mallory = pb_grpc.CoordinatorStub(channels(c, "mallory"))
    watches = [mallory.WatchRounds(pb.WatchRequest(from_round=0), timeout=600) for _ in range(120)]
    bound = cfg.limits.watch_streams_per_credential
    deadline = time.monotonic() + 60
    while sum(w.done() for w in watches) < len(watches) - bound and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = [w for w in watches if w.done()]
    assert len(refused) == len(watches) - bound  # 160 held calls took every server thread: no round, no health check
    assert {reason_of(w) for w in refused} == {Reason.TOO_MANY_STREAMS}
    ca, cert, key = credentials.island_files(run_ca, "east").read()
    with grpc.secure_channel(f"127.0.0.1:{c.port}", grpc.ssl_channel_credentials(ca, key, cert)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    try:
        with members(Member(channels(c, "east"), cfg), Member(channels(c, "west"), cfg)):
            assert rounds_close(c, 3) == 3
            held = [w for w in watches if not w.done()]
            assert len(held) == bound and all(next(w).round == 0 for w in held)  # the watches it may hold still work
    finally:
        for w in watches:
            w.cancel()


def test_a_revoked_credentials_open_streams_end_and_its_new_calls_are_refused(coordinator, channels, run_ca):
    c = coordinator()
    cfg = c.state.cfg
    mallory_channel = channels(c, "mallory")
    mallory = pb_grpc.CoordinatorStub(mallory_channel)
    east = Member(channels(c, "east"), cfg)  # joined, never pushes: round 0 stays open
    member = Member(mallory_channel, cfg)
    member.push()
    waiting = mallory.PullRoundResult(pb.PullRequest(island_id=member.island_id, round=0, timeout_s=300), timeout=600)
    watch = mallory.WatchRounds(pb.WatchRequest(from_round=0), timeout=600)
    stalled = mallory.FetchParameters(pb.FetchRequest(), timeout=600)
    assert next(stalled).HasField("header")
    time.sleep(1.0)  # every call reached its handler
    assert not any(call.done() for call in (waiting, watch, stalled))
    assert credentials.revoke(run_ca, "mallory", "key leaked")
    for call in (waiting, watch):
        with pytest.raises(grpc.RpcError) as e:
            next(call)
        assert reason_of(e.value) == Reason.REVOKED
    time.sleep(5.0)  # stalled in a send, it would never read a refusal: cancelled a couple of seconds after
    with pytest.raises(grpc.RpcError) as e:
        list(stalled)
    assert e.value.code() == grpc.StatusCode.CANCELLED or reason_of(e.value) == Reason.REVOKED
    for call in (lambda: next(mallory.WatchRounds(pb.WatchRequest(from_round=0), timeout=30)),
                 lambda: next(mallory.FetchParameters(pb.FetchRequest(), timeout=30))):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert reason_of(e.value) == Reason.REVOKED
    with members(east, Member(channels(c, "west"), cfg)):
        assert rounds_close(c, 3) == 3
