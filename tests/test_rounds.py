"""The coordinator's round state machine without gRPC, on an injected clock.

Pushes go straight into CoordinatorState.receive and the driver is stepped by
hand, so close conditions, leases, deadlines and refusals are decided by the
test's clock alone, and the aggregate can be checked against every order in
which pushes may arrive.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from conftest import claim, random_like, trained_from
from kit import SHARES, Clock, join_shares, make_state, push, push_share, refusal, share_tokens
from diloco.wire.frames import serialized_values
from coordinator.spool import Spool, SpoolCorrupt
from diloco.wire.refusal import Reason, Refused
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import payload_digest, tensor_chunks, uplink_codec

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_aggregate_is_bit_identical_for_every_arrival_order(tmp_path, codec):
    """Three islands with unequal tokens, pushed in all six orders, two rounds with Nesterov momentum."""
    results = []
    for order in itertools.permutations(SHARES):
        state = make_state(tmp_path, "rounds.rounds=2", f"wire.codec='{codec}'", "outer.lr=0.7", "outer.momentum=0.9")
        join_shares(state)
        for round_ in range(2):
            for island_id in order:
                seed = 10 * round_ + int(island_id[-1])
                assert push_share(state, island_id, random_like(state.manifest.shapes, seed), round_).contribution_complete
            closed = state.fragments[0].step(poll_s=0)
            assert closed is not None and closed.summary.tokens == share_tokens(state)
        results.append((order, {n: t.clone() for n, t in state.params.items()}, state.checksum))
    first_order, first, first_sum = results[0]
    for order, params, digest in results[1:]:
        assert digest == first_sum, f"arrival order {order} gave other global parameters than {first_order}"
        for name, t in params.items():
            assert torch.equal(t, first[name]), (order, name)


def test_round_waits_for_every_live_island_then_closes(tmp_path):
    clock = Clock()
    state = make_state(tmp_path, "rounds.min_islands=1", "rounds.deadline_s=30", clock=clock)
    a, b = state.join("a").island_id, state.join("b").island_id
    push(state, a, random_like(state.manifest.shapes, 1))
    assert state.fragments[0].step(poll_s=0) is None, "closed while a live island had not pushed"
    push(state, b, random_like(state.manifest.shapes, 2))
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None and list(closed.summary.islands) == [a, b] and state.round == 1


def test_deadline_closes_with_min_islands_and_not_below(tmp_path):
    clock = Clock()
    state = make_state(tmp_path, "rounds.min_islands=2", "rounds.deadline_s=30", "rounds.lease_s=1000", clock=clock)
    a, b, c = (state.join(h).island_id for h in "abc")
    push(state, a, random_like(state.manifest.shapes, 1))
    clock.now += 31
    assert state.fragments[0].step(poll_s=0) is None, "closed past the deadline below min_islands"
    push(state, b, random_like(state.manifest.shapes, 2))
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None and list(closed.summary.islands) == [a, b], "the deadline did not close the round"
    # The late island's push for the closed round is refused, naming the current round.
    r = refusal(lambda: push(state, c, random_like(state.manifest.shapes, 3)))
    assert r.reason == Reason.ROUND_CLOSED and r.current_round == 1
    assert state.events.late_pushes == 1


def test_expired_lease_stops_holding_the_round_and_drops_a_half_push(tmp_path):
    clock = Clock()
    # b's lease expires in round 0: a closes it alone, the run's first outer step (robust.first_quorum 1).
    state = make_state(tmp_path, "rounds.min_islands=1", "robust.first_quorum=1", "rounds.lease_s=10", "rounds.deadline_s=1000",
                       clock=clock)
    a, b = state.join("a").island_id, state.join("b").island_id
    pg = random_like(state.manifest.shapes, 5)
    codec = uplink_codec(state.cfg.wire)
    chunks = list(tensor_chunks(pg, codec, state.cfg.wire.chunk_bytes))
    header = pb.PushHeader(island_id=b, round=0, train_loss=2.0, codec=codec.name, **claim(state.cfg), global_checksum=trained_from(state))
    assert not state.receive(header, iter(chunks[:2])).contribution_complete  # b's push breaks off half-way
    push(state, a, random_like(state.manifest.shapes, 1))
    assert state.fragments[0].step(poll_s=0) is None, "closed while b's lease held"
    clock.now += 11
    state.touch(a)
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None and list(closed.summary.islands) == [a]
    assert closed.summary.elements_folded == closed.summary.elements_expected == state.manifest.total_numel()
    assert state.events.leases_expired == 1 and b not in state.islands
    assert r_reason(lambda: state.touch(b)) == Reason.NOT_A_MEMBER
    assert not list(state.spool_dir.iterdir()), "the dropped half-push left its spool behind"


def r_reason(call) -> int:
    return refusal(call).reason


def test_max_islands_closes_at_once(tmp_path):
    state = make_state(tmp_path, "rounds.min_islands=1", "rounds.max_islands=2")
    a, b = state.join("a").island_id, state.join("b").island_id
    push(state, a, random_like(state.manifest.shapes, 1))
    push(state, b, random_like(state.manifest.shapes, 2))
    assert r_reason(lambda: state.join("c")) == Reason.RUN_FULL
    assert state.fragments[0].step(poll_s=0) is not None


def test_pull_refusals_say_what_to_do(tmp_path):
    state = make_state(tmp_path, "rounds.min_islands=1", "robust.first_quorum=1")  # one island: no second to wait for
    a = state.join("a").island_id
    # Nothing pushed for the open round: the coordinator (restarted, say) asks for the push again.
    r = refusal(lambda: state.wait_for_result(a, 0, timeout_s=0))
    assert r.reason == Reason.PUSH_AGAIN and r.current_round == 0
    assert r_reason(lambda: state.wait_for_result(a, 3, timeout_s=0)) == Reason.ROUND_AHEAD
    push(state, a, random_like(state.manifest.shapes, 1))
    assert r_reason(lambda: push(state, a, random_like(state.manifest.shapes, 1))) == Reason.DUPLICATE
    assert r_reason(lambda: state.wait_for_result(a, 0, timeout_s=0)) == Reason.STILL_OPEN
    assert state.fragments[0].step(poll_s=0) is not None
    assert state.wait_for_result(a, 0, timeout_s=0) >= 0.0


def test_nonfinite_push_drops_the_island_from_the_round(tmp_path):
    state = make_state(tmp_path, "rounds.min_islands=1", "robust.first_quorum=1")  # the other island closes round 0 alone
    a, b = state.join("a").island_id, state.join("b").island_id
    bad = random_like(state.manifest.shapes, 1)
    bad["norm.weight"][3] = float("nan")
    assert r_reason(lambda: push(state, a, bad)) == Reason.NOT_FINITE
    assert r_reason(lambda: push(state, a, random_like(state.manifest.shapes, 1))) == Reason.DROPPED
    push(state, b, random_like(state.manifest.shapes, 2))
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None and list(closed.summary.islands) == [b] and list(closed.summary.dropped) == [a]
    assert all(torch.isfinite(t).all() for t in state.params.values())


def test_a_pull_for_ranges_the_coordinator_lacks_asks_for_them_again(tmp_path):
    """After a restart each rank of a sharded island pushes its own shard again: a rank whose ranges
    are not here is told to push again, even when another rank's part of the contribution arrived."""
    from diloco.wire.messages import FlatRange

    state = make_state(tmp_path, "rounds.min_islands=1")
    a = state.join("a").island_id
    codec = uplink_codec(state.cfg.wire)
    pg = random_like(state.manifest.shapes, 1)
    first = {"embed.weight": pg["embed.weight"]}  # rank 0's part only
    header = pb.PushHeader(island_id=a, round=0, train_loss=2.0, codec=codec.name, **claim(state.cfg), global_checksum=trained_from(state))
    assert not state.receive(header, tensor_chunks(first, codec, state.cfg.wire.chunk_bytes)).contribution_complete
    mine = [FlatRange("embed.weight", 0, state.manifest.numel("embed.weight"))]
    theirs = [FlatRange("norm.weight", 0, state.manifest.numel("norm.weight"))]
    assert r_reason(lambda: state.wait_for_result(a, 0, timeout_s=0, ranges=mine)) == Reason.STILL_OPEN
    assert r_reason(lambda: state.wait_for_result(a, 0, timeout_s=0, ranges=theirs)) == Reason.PUSH_AGAIN
    assert r_reason(lambda: state.wait_for_result(a, 0, timeout_s=0)) == Reason.PUSH_AGAIN


def test_spool_reads_back_what_was_written_and_refuses_a_damaged_file(tmp_path):
    spool = Spool(tmp_path)
    records = [("blocks.0.w", 0, 3, b"\x01\x02\x03\x04" * 3), ("embed", 4096, 1, b"\xff\x00\x7f\x80")]
    for name, offset, numel, payload in records:
        spool.write(name, offset, numel, payload_digest(payload), payload)
    assert [(c.name, c.offset, c.numel, bytes(c.payload)) for c in spool.read()] == records
    data = bytearray(spool.path.read_bytes())
    data[-1] ^= 0xFF
    spool.path.write_bytes(bytes(data))
    with pytest.raises(SpoolCorrupt, match="embed@4096"):
        list(spool.read())
    spool.discard()
    assert not spool.path.exists()


def test_a_pull_frames_the_values_from_the_parameters_and_a_read_across_a_step_goes_on_from_disk(tmp_path):
    """No copy of the values is held: a pull frames them from the parameters; a read that straddles the outer step
    goes on from a copy written to disk before it, with the values it started on."""
    state = make_state(tmp_path, "rounds.min_islands=1", "wire.chunk_bytes=4096")
    publication = state.fragments[0].publication
    first = publication.value_messages()
    assert publication.value_messages() is first  # one version a round
    expected = list(serialized_values(publication.params, 4096))
    assert len(expected) > 10
    assert [m.data for m in first.messages()] == expected
    for blob, size in first:
        message = pb.ResultMessage.FromString(blob)
        assert size == len(blob) == message.ByteSize() and message.chunk.numel > 0
    assert first.held_bytes() == 8 * len(expected)  # only the chunks' digests
    assert first.spilled_bytes() == 0
    # A reader has read one message when the step comes.
    values, done = publication.open_values()
    reading = values.messages()
    got = [next(reading)]
    publication.release_values()
    assert values.spilled_bytes() == sum(len(data) for data in expected)
    assert publication.held_values()["values_on_disk"] == values.spilled_bytes()
    with torch.no_grad():
        for t in publication.params.values():
            t.add_(1.0)  # the step
    publication.publish()
    got += list(reading)
    assert [m.data for m in got] == expected  # the values it started on, from disk
    after = publication.value_messages()
    assert after is not values and next(after.messages()).data != expected[0]
    # Read to the end and released: the next step drops that version and its file.
    done()
    publication.release_values()
    publication.publish()
    assert values.spilled_bytes() == 0 and publication.held_values()["values_on_disk"] == 0
    with pytest.raises(Refused) as e:
        next(values.messages())
    assert e.value.reason == Reason.ROUND_CLOSED


def test_values_that_cannot_be_kept_past_the_step_cut_their_readers_off_and_the_step_goes_on(tmp_path):
    """The disk for a slow reader's copy gone: its read ends ROUND_CLOSED (it fetches again), nothing raises."""
    state = make_state(tmp_path, "rounds.min_islands=1", "wire.chunk_bytes=4096")
    publication = state.fragments[0].publication
    publication.spill_dir = str(tmp_path / "no such folder")
    cut = []
    values, done = publication.open_values(lambda: cut.append(True))
    reading = values.messages()
    next(reading)
    publication.release_values()  # the step is coming: the copy cannot be written
    assert cut == [True] and values.spilled_bytes() == 0
    with pytest.raises(Refused) as e:
        next(reading)
    assert e.value.reason == Reason.ROUND_CLOSED
    done()
    publication.publish()  # the step and publication go on
    assert next(publication.value_messages().messages()).data
