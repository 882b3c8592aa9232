"""Limits that keep a run alive (issue 15, item 4): each bound refused with its own reason and status."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
import torch

from conftest import one_island_config, tiny_config, trained_from, wait_for_round
from kit import Clock
from coordinator.server import start_coordinator
from coordinator.limits import TokenBucket
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks


def _join(stub, **fields) -> str:
    return stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, **fields), timeout=10).island_id


def _chunks(coordinator, seed: int = 0) -> list[pb.TensorChunk]:
    g = torch.Generator().manual_seed(seed)
    pg = {n: torch.randn(s, generator=g) * 1e-3 for n, s in coordinator.state.manifest.shapes.items()}
    return list(tensor_chunks(pg, Fp32Codec(), 4096))


def _header(coordinator, island: str, round_: int = 0) -> pb.PushHeader:
    return pb.PushHeader(island_id=island, round=round_, tokens=128, codec="fp32", inner_steps=1,
                         global_checksum=trained_from(coordinator, round_))


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


@pytest.mark.unit
def test_a_token_bucket_allows_its_burst_then_its_rate():
    clock = Clock(0.0)
    bucket = TokenBucket(rate=2.0, burst=3.0, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.now = 0.5  # one token back
    assert [bucket.take() for _ in range(2)] == [True, False]
    clock.now = 100.0  # never more than the burst
    assert sum(bucket.take() for _ in range(10)) == 3


@pytest.mark.integration
def test_a_push_stream_that_goes_quiet_is_cut_off_and_its_part_dropped(make_coordinator, channel_to):
    coordinator = make_coordinator(one_island_config("limits.push_idle_s=1"))
    stub = channel_to(coordinator)
    island = _join(stub)
    chunks = _chunks(coordinator)
    release = threading.Event()

    def stalls():
        yield pb.PushMessage(header=_header(coordinator, island))
        yield pb.PushMessage(chunk=chunks[0])
        release.wait(120)  # then nothing: a client that stopped sending but keeps the stream open

    future = stub.PushPseudoGradient.future(stalls(), timeout=120)
    try:
        error = future.exception(100)
    finally:
        release.set()
    assert error is not None and reason_of(error) == Reason.STREAM_IDLE
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "limits.push_idle_s" in error.details()
    spools = coordinator.state.fragments[0].ctx.spools
    assert spools.used == 0 and not list(spools.directory.iterdir()), "the cut-off stream's chunk was kept"
    deadline = time.monotonic() + 60  # the server's reader of that stream ends with the call
    while any(t.name == "push-reader" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "push-reader" for t in threading.enumerate())
    # The island pushes its whole contribution again; nothing of the cut-off stream counts against it.
    response = stub.PushPseudoGradient(push_messages(_header(coordinator, island), chunks), timeout=30)
    assert response.contribution_complete
    wait_for_round(coordinator, 0, timeout_s=60)


@pytest.mark.integration
def test_a_member_trickling_its_push_just_inside_the_idle_bound_does_not_hold_the_round(make_coordinator, channel_to):
    """The attacker (a member with a valid key) sends a chunk every 0.8 s, inside limits.push_idle_s = 1, so the idle
    bound never cuts it: its 13 chunks would hold round 0 for 10 s, and a whole model's worth of such pushes to the
    deadline. Below limits.push_floor_mbps (1 Mbit/s, the default) once its grace of push_idle_s is spent, it is cut
    off, and the round closes on the two honest islands without waiting for it."""
    cfg = tiny_config("limits.push_idle_s=1", "rounds.min_islands=2", "rounds.deadline_s=600",
                      "limits.idle_rounds=0")  # the attacker, which never contributes, stays a member
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    east, west, mallory = _join(stub, island_key="east"), _join(stub, island_key="west"), _join(stub, island_key="mallory")
    chunks = _chunks(coordinator)
    assert len(chunks) >= 10
    stop = threading.Event()

    def trickles():
        yield pb.PushMessage(header=_header(coordinator, mallory))
        for chunk in chunks:
            if stop.wait(0.8):
                return
            yield pb.PushMessage(chunk=chunk)
        stop.wait(120)

    started = time.monotonic()
    attack = stub.PushPseudoGradient.future(trickles(), timeout=120)
    try:
        for seed, island in enumerate((east, west), start=1):
            reply = stub.PushPseudoGradient(push_messages(_header(coordinator, island), _chunks(coordinator, seed)), timeout=60)
            assert reply.contribution_complete
        error = attack.exception(60)
        cut_s = time.monotonic() - started
        wait_for_round(coordinator, 0, timeout_s=60)
    finally:
        stop.set()
    assert error is not None and reason_of(error) == Reason.STREAM_IDLE and "push_floor_mbps" in error.details(), error
    assert sorted(coordinator.state.summaries[0].islands) == sorted([east, west])
    # Cut off before its trickle could end: the bound, not the attacker, decided when round 0 stopped waiting for it.
    assert cut_s < 0.8 * len(chunks), cut_s


@pytest.mark.integration
def test_a_member_pushing_above_the_floor_but_far_slower_than_the_others_does_not_hold_the_round(make_coordinator, channel_to):
    """The attacker keeps above limits.push_floor_mbps (a large model's push at just over 1 Mbit/s takes hours; here
    the floor is lowered so that the tiny model's trickle stays above it, and push_idle_s raised past its 2 s between
    chunks so that the idle bound does not cut it): once the two honest islands are in, its own pace says it would
    take far longer than push_pace_factor times theirs, and the round closes without it, its stream still open."""
    cfg = tiny_config("limits.push_floor_mbps=0.001", "limits.push_idle_s=3", "rounds.min_islands=2",
                      "rounds.deadline_s=600", "limits.idle_rounds=0")  # the attacker, which never contributes, stays a member
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    east, west, mallory = _join(stub, island_key="east"), _join(stub, island_key="west"), _join(stub, island_key="mallory")
    chunks = _chunks(coordinator)
    assert len(chunks) >= 10
    stop, sent = threading.Event(), []

    def trickles():
        yield pb.PushMessage(header=_header(coordinator, mallory))
        for chunk in chunks:
            sent.append(chunk)
            yield pb.PushMessage(chunk=chunk)
            if stop.wait(2.0):
                return
        stop.wait(120)

    attack = stub.PushPseudoGradient.future(trickles(), timeout=120)
    try:
        for seed, island in enumerate((east, west), start=1):
            reply = stub.PushPseudoGradient(push_messages(_header(coordinator, island), _chunks(coordinator, seed)), timeout=60)
            assert reply.contribution_complete
        wait_for_round(coordinator, 0, timeout_s=60)
        at_close = len(sent)
    finally:
        stop.set()
    assert at_close < len(chunks), "the round waited for the whole trickle"
    summary = coordinator.state.summaries[0]
    assert sorted(summary.islands) == sorted([east, west])
    assert "pushing too slowly" in coordinator.state.fragments[0].last_close_reason
    assert attack.exception(60) is not None  # its stream, ended by the test, was not taken


@pytest.mark.integration
def test_heartbeats_beyond_the_rate_are_refused(make_coordinator, channel_to):
    # heartbeat_s so long that no token comes back during the test: the bound is the burst, 2 x 4 x 1 rank.
    coordinator = make_coordinator(tiny_config("rounds.heartbeat_s=10000", "rounds.lease_s=100000"))
    stub = channel_to(coordinator)
    island = _join(stub)
    for _ in range(8):
        stub.Heartbeat(pb.HeartbeatRequest(island_id=island), timeout=10)
    error = _refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(island_id=island), timeout=10))
    assert reason_of(error) == Reason.RATE_LIMITED and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    other = _join(stub)  # another island's bucket is its own
    stub.Heartbeat(pb.HeartbeatRequest(island_id=other), timeout=10)


@pytest.mark.integration
def test_the_spool_is_bounded_and_a_stream_cannot_repeat_its_chunks(make_coordinator, channel_to):
    coordinator = make_coordinator(tiny_config("limits.spool_gb=0.000002"))  # 2,000 bytes: less than one chunk
    stub = channel_to(coordinator)
    island = _join(stub)
    chunks = _chunks(coordinator)
    error = _refused(lambda: stub.PushPseudoGradient(push_messages(_header(coordinator, island), chunks), timeout=30))
    assert reason_of(error) == Reason.SPOOL_FULL and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    spools = coordinator.state.fragments[0].ctx.spools
    assert spools.used == 0 and not list(spools.directory.iterdir())

    roomy = make_coordinator(tiny_config())
    stub = channel_to(roomy)
    island = _join(stub)
    small = min(chunks, key=lambda c: c.numel)
    repeats = roomy.state.manifest.total_numel() // small.numel + 1  # one more than the fragment holds
    error = _refused(lambda: stub.PushPseudoGradient(push_messages(_header(roomy, island), [small] * repeats), timeout=60))
    assert reason_of(error) == Reason.BAD_CHUNK and "more than the" in error.details()
    assert roomy.state.fragments[0].ctx.spools.used == 0


@pytest.mark.integration
def test_an_island_that_never_pushes_is_removed_and_on_probation_holds_no_round(make_coordinator, channel_to, caplog):
    # The worker is the only island that pushes: the run's first outer step has no second (robust.first_quorum 1).
    cfg = one_island_config("rounds.rounds=6", "rounds.deadline_s=1", "rounds.lease_s=100000", "limits.idle_rounds=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    worker, idler = _join(stub, island_key="w"), _join(stub, island_key="i")
    caplog.set_level(logging.INFO, logger="coordinator.state")  # where the round-closed line is logged

    def round_with_worker(round_: int) -> None:
        stub.PushPseudoGradient(push_messages(_header(coordinator, worker, round_), _chunks(coordinator, round_)), timeout=30)
        wait_for_round(coordinator, round_, timeout_s=60)

    for round_ in range(3):  # round 0 opened before the idler joined: it does not count
        round_with_worker(round_)
    closed_by = {r: m for r in range(6) for m in caplog.messages if m.startswith(f"round {r} closed")}
    assert all("(deadline)" in closed_by[r] for r in range(3)), closed_by  # each round waited for the idler
    assert idler not in coordinator.state.islands and coordinator.state.events.idle_removed == 1
    error = _refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(island_id=idler), timeout=10))
    assert reason_of(error) == Reason.NOT_A_MEMBER
    assert _join(stub, island_id=idler) == idler  # back as itself, on probation
    assert coordinator.state.islands[idler].probation
    round_with_worker(3)
    closed_by = {r: m for r in range(6) for m in caplog.messages if m.startswith(f"round {r} closed")}
    assert "(every live island contributed)" in closed_by[3], closed_by  # it no longer holds rounds up
    # Once it contributes it is a member like any other again.
    stub.PushPseudoGradient(push_messages(_header(coordinator, idler, 4), _chunks(coordinator, 40)), timeout=30)
    round_with_worker(4)
    assert not coordinator.state.islands[idler].probation


@pytest.fixture
def run_ca(tmp_path):
    d = tmp_path / "tls"
    credentials.create_ca(d)
    credentials.issue_coordinator(d, ["127.0.0.1"])
    credentials.issue_island(d, "east")
    return d


@pytest.mark.integration
def test_a_credential_holds_one_island_and_joins_at_a_bounded_rate(run_ca, tmp_path):
    coordinator = start_coordinator(tiny_config("limits.joins_per_minute=4"), "127.0.0.1", 0, spool_dir=str(tmp_path / "spool"),
                                    tls=credentials.coordinator_files(run_ca))
    ca, cert, key = credentials.island_files(run_ca, "east").read()
    channel = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert))
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        # Fresh ids, as in the join flood of issue 15: one credential, one island, named as its certificate is.
        ids = {_join(stub, island_id=f"flood-{i}") for i in range(4)}
        assert ids == {"east"} and list(coordinator.state.islands) == ["east"]
        error = _refused(lambda: _join(stub, island_id="flood-4"))  # the 5th within a minute
        assert reason_of(error) == Reason.RATE_LIMITED and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        channel.close()
        coordinator.stop(0.5)



@pytest.mark.integration
def test_non_finite_numbers_in_requests_are_refused_not_waited_on(make_coordinator, channel_to):
    coordinator = make_coordinator(tiny_config())
    stub = channel_to(coordinator)
    island = _join(stub)
    chunks = _chunks(coordinator)
    for timeout in (float("nan"), float("inf"), -1.0):  # a NaN wait never ended: one server thread spun for ever
        request = pb.PullRequest(island_id=island, round=0, timeout_s=timeout)
        error = _refused(lambda: list(stub.PullRoundResult(request, timeout=30)))
        assert reason_of(error) == Reason.BAD_REQUEST and "timeout_s" in error.details()
    header = _header(coordinator, island)
    header.train_loss = float("nan")
    error = _refused(lambda: stub.PushPseudoGradient(push_messages(header, chunks), timeout=30))
    assert reason_of(error) == Reason.NOT_FINITE and "train_loss" in error.details()
    assert stub.PushPseudoGradient(push_messages(_header(coordinator, island), chunks), timeout=30).contribution_complete


@pytest.mark.integration
def test_what_the_fuzzer_found_stays_fixed(make_coordinator, channel_to):
    """Three findings of tests/test_fuzz.py, each as its own case."""
    # The claim check off, as when the freeze was found: it refuses inner_steps = 2**62 before lr_sum, the subject here.
    coordinator = make_coordinator(tiny_config("rounds.lease_s=100000", "robust.check_claims=false"))
    stub = channel_to(coordinator)
    island = _join(stub)
    # A 20 KB island id quoted in the refusal pushed the status past gRPC's metadata limit: no status, no reason.
    error = _refused(lambda: stub.Heartbeat(pb.HeartbeatRequest(island_id="z" * 20_000), timeout=30))
    assert reason_of(error) == Reason.NOT_A_MEMBER and len(error.details()) < 1100
    # inner_steps = 2**62 summed 2**62 learning rates holding the round's lock: every call froze.
    header = _header(coordinator, island)
    header.inner_steps = 2**62
    stub.PushPseudoGradient(push_messages(header, _chunks(coordinator)), timeout=60)
    stub.Heartbeat(pb.HeartbeatRequest(island_id=island), timeout=60)
    # Watches abandoned by their callers held a server thread each until the next round: 200 filled them all.
    for _ in range(200):
        with pytest.raises(grpc.RpcError):
            list(stub.WatchRounds(pb.WatchRequest(from_round=10**6), timeout=0.05))
    stub.Heartbeat(pb.HeartbeatRequest(island_id=island), timeout=60)
