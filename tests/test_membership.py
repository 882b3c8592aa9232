"""Membership: leases, round deadlines, min_islands, and islands joining a run that is under way."""

from __future__ import annotations

import logging
import signal
import time

import grpc
import torch
import pytest

from conftest import PER_STEP, claim, ended, join, one_island_config, random_like, tiny_config, trained_from, wait_for_round
from diloco.wire.codec import Fp32Codec
from islands.sim.simulation import Simulation
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, tensor_chunks

pytestmark = pytest.mark.integration


def _push(coordinator, stub, island_id, manifest, round_=0, seed=0):
    header = pb.PushHeader(island_id=island_id, round=round_, codec="fp32", **claim(tiny_config()),
                           global_checksum=trained_from(coordinator, round_))
    messages = [pb.PushMessage(header=header)]
    messages += [pb.PushMessage(chunk=c) for c in tensor_chunks(random_like(manifest.shapes, seed), Fp32Codec(), 4096)]
    return stub.PushPseudoGradient(ended(messages), timeout=10)


def test_island_that_misses_its_lease_leaves_the_round(make_coordinator, channel_to):
    # b's lease expires: a closes round 0 alone, the run's first outer step (robust.first_quorum 1).
    cfg = one_island_config("rounds.lease_s=1.0", "rounds.deadline_s=60", "rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub), join(stub)
    manifest = Manifest.from_proto(a.parameters)
    _push(coordinator, stub, a.island_id, manifest)
    # b never heartbeats: the round waits for it only until its lease runs out.
    wait_for_round(coordinator, 0, timeout_s=10)
    summary = coordinator.state.summaries[0]
    assert 1.0 <= summary.seconds < 4.0
    assert list(summary.islands) == [a.island_id]
    assert coordinator.state.events.leases_expired >= 1
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(island_id=b.island_id), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "join again" in err.value.details()
    assert join(stub).round == 1  # coming back is a fresh join into the current round


def test_round_closes_at_its_deadline_with_min_islands(make_coordinator, channel_to):
    cfg = tiny_config("rounds.min_islands=2", "rounds.deadline_s=1.5", "rounds.lease_s=60", "rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b, c = join(stub), join(stub), join(stub)
    manifest = Manifest.from_proto(a.parameters)
    _push(coordinator, stub, a.island_id, manifest, seed=1)
    _push(coordinator, stub, b.island_id, manifest, seed=2)
    wait_for_round(coordinator, 0, timeout_s=10)
    assert 1.5 <= coordinator.state.summaries[0].seconds < 4.0  # waited for c until the deadline, not longer
    assert sorted(coordinator.state.summaries[0].islands) == sorted([a.island_id, b.island_id])
    # c's late push for the closed round is refused; it must resync and train for round 1.
    with pytest.raises(grpc.RpcError) as err:
        _push(coordinator, stub, c.island_id, manifest, round_=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_round_below_min_islands_keeps_waiting_and_says_why(make_coordinator, channel_to, caplog):
    cfg = tiny_config("rounds.min_islands=2", "rounds.deadline_s=0.5", "rounds.lease_s=60", "rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub), join(stub)
    manifest = Manifest.from_proto(a.parameters)
    with caplog.at_level(logging.WARNING, logger="coordinator.state"):
        _push(coordinator, stub, a.island_id, manifest)
        time.sleep(1.5)
    assert coordinator.state.round == 0, "closed below min_islands"
    assert any("past its 0.5s deadline with 1 of min_islands=2" in r.message for r in caplog.records), caplog.text
    _push(coordinator, stub, b.island_id, manifest, seed=3)
    wait_for_round(coordinator, 0, timeout_s=10)
    assert len(coordinator.state.summaries[0].islands) == 2


def test_island_joining_a_run_under_way_enters_the_current_round(tmp_path):
    # The first island runs alone until the second comes online: its first outer step has no second to wait for.
    cfg = one_island_config(
        "rounds.rounds=5", "rounds.min_islands=1", "data.shards=2", "inner.steps_per_round=5",
        "rounds.heartbeat_s=0.5", "rounds.lease_s=60",
    )
    sim = Simulation(cfg, 2, tmp_path)
    coordinator_log = tmp_path / "coordinator.log"
    try:
        sim.started = time.monotonic()
        sim.start_coordinator()
        sim.start_island(0)
        rounds = []
        for summary in sim.watch(240):
            rounds.append(list(summary.islands))
            if summary.round == 1:
                # A second data centre comes online mid-run. Hold the first one still
                # until it has joined, so the run cannot finish before it arrives.
                sim.island_procs[0].send_signal(signal.SIGSTOP)
                sim.start_island(1)
                deadline = time.monotonic() + 120
                while "island-1 joined" not in coordinator_log.read_text():
                    assert time.monotonic() < deadline and sim.island_procs[1].poll() is None, "island-1 never joined"
                    time.sleep(0.1)
                sim.island_procs[0].send_signal(signal.SIGCONT)
        result = sim.finish(240)
    finally:
        sim.island_procs[0].send_signal(signal.SIGCONT)
        sim.close()
    assert rounds[0] == ["island-0"] and rounds[1] == ["island-0"]
    assert rounds[-1] == ["island-0", "island-1"], rounds
    # The newcomer fetched the current global parameters and ends holding the final ones.
    assert result.report["islands"] == {"island-0": result.report["checksum"], "island-1": result.report["checksum"]}


def test_island_keeps_waiting_for_a_round_held_open_below_min_islands(make_coordinator, channel_to):
    """A pull that times out on a round still open (too few islands) waits on instead of failing the island."""
    import threading

    from diloco.params import checksum
    from diloco.wire.messages import FlatRange
    from islands.client import CoordinatorClient
    from islands.outcome import Next
    from islands.round import Exchange, FragmentShard, Wire, pull, push

    cfg = tiny_config("rounds.min_islands=2", "rounds.deadline_s=0.2", "rounds.lease_s=60", "rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub), join(stub)
    manifest = Manifest.from_proto(a.parameters)
    targets = {n: torch.zeros(s) for n, s in manifest.shapes.items()}
    ranges = [FlatRange(n, 0, manifest.numel(n)) for n in manifest.shapes]
    shard = FragmentShard(0, manifest, ranges, True, {n: torch.zeros(manifest.numel(n)) for n in manifest.shapes}, targets)
    pg = {n: t.reshape(-1) for n, t in random_like(manifest.shapes, 0).items()}
    ex = Exchange(0, 0, 0, 0, tokens=PER_STEP, inner_steps=1, train_loss=0.0, checksum=trained_from(coordinator), pusher=True,
                  pg=pg)
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    wire = Wire(client, Fp32Codec(), 4096, None, pull_timeout_s=0.3, island_id=lambda: a.island_id)
    outcome: list = []

    def island_a():
        try:
            assert push(shard, ex, wire) is Next.DELIVERED
            outcome.append(pull(shard, ex, wire))
        except Exception as e:  # noqa: BLE001 - the test reports it
            outcome.append(e)

    thread = threading.Thread(target=island_a)
    thread.start()
    time.sleep(2.0)  # several of a's pull timeouts pass while the round waits for b
    assert not outcome, outcome
    _push(coordinator, stub, b.island_id, manifest, seed=3)
    thread.join(20)
    client.close()
    assert len(outcome) == 1 and isinstance(outcome[0], pb.ResultHeader), outcome
    assert outcome[0].round == 1 and outcome[0].checksum == coordinator.state.checksum  # the round closed: now round 1
    assert checksum(targets) == coordinator.state.checksum


def test_leave_stops_the_heartbeat_first_so_no_refusal_follows_it(make_coordinator):
    """A heartbeat sent after Leave is refused NOT_A_MEMBER and counted in the run's report (a CI flake of
    test_streaming_claims): leave() stops the heartbeat, and waits for one in flight, before it leaves."""
    from islands.client import CoordinatorClient
    coordinator = make_coordinator(one_island_config())
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=30)
    try:
        joined = client.join()
        beats = []
        client.start_heartbeat(lambda: joined.island_id, 0.005, lambda: 0, lambda: beats.append(1) or {})
        deadline = time.monotonic() + 60
        while len(beats) < 3 and time.monotonic() < deadline:  # heartbeating for real before we leave
            time.sleep(0.01)
        assert len(beats) >= 3
        client.leave(joined.island_id, "", 0)
        assert not client._heartbeat.is_alive()
        sent = len(beats)
        time.sleep(0.1)  # 20 intervals: a heartbeat thread still running would have beaten again
        assert len(beats) == sent
        assert coordinator.state.events.refusals == {}, coordinator.state.events.refusals
    finally:
        client.close()
