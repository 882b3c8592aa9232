"""Time-boxed rounds with streaming fragments and overlap, and rounds that do not wait for an island that is behind.

- The coordinator: with rounds.late_rounds > 0 a round does not wait for an
  island whose last contribution came late (it is folded late again if it
  misses the round), until it contributes on time again (injected clock, no gRPC).
- The island's time box: one clock per fragment, the first round of fragment f
  (H - o_f) / H of round_s, time blocked on a result not counted.
- Real islands on threads: a time-boxed run with P = 2 fragments and tau = 1,
  one island throttled; every fragment's copies end on the coordinator's.
Every wait is on an event with a generous bound.
"""

from __future__ import annotations

import pytest

from conftest import PER_STEP, random_like, tiny_config
from kit import NESTEROV, Clock, islands_on_threads, make_state, push_tokens
from islands.round import RoundPace
from islands.state import ReplicaSpec


HONEST = 2 * PER_STEP  # push_tokens()'s default two inner steps on one rank


@pytest.mark.unit
def test_a_round_does_not_wait_for_an_island_whose_last_contribution_came_late(tmp_path):
    clock = Clock()
    # robust.first_quorum 1: round 0 closes at its deadline with a alone.
    state = make_state(tmp_path, *NESTEROV, "rounds.rounds=6", "rounds.late_rounds=2", "rounds.deadline_s=30",
                       "rounds.lease_s=10000", "limits.idle_rounds=0", "robust.first_quorum=1", clock=clock)
    a, b = (state.join(h).island_id for h in "ab")
    pg = {k: random_like(state.manifest.shapes, k) for k in range(8)}
    start = [state.checksum]

    # Round 0 closes at its deadline with a alone; b's push for it arrives after it closed.
    push_tokens(state, a, pg[0], HONEST, 0, checksum=state.checksum)
    assert state.fragments[0].step(poll_s=0) is None, "round 0 did not wait for b"
    clock.now += 31
    assert state.fragments[0].step(poll_s=0).summary.round == 0
    start.append(state.checksum)
    assert push_tokens(state, b, pg[1], HONEST, 0, checksum=start[0]).late
    # b is behind: rounds 1 and 2 close on a's push, no deadline passing (the clock stands still).
    for round_ in (1, 2):
        push_tokens(state, a, pg[2 + round_], HONEST, round_, checksum=state.checksum)
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None, f"round {round_} waited for b"
        assert [(c.island_id, c.staleness) for c in closed.summary.contributions] == ([(a, 0), (b, 1)] if round_ == 1 else [(a, 0)])
    # b pushes round 3 on time, before a: the round waits for a, and closes with both.
    push_tokens(state, b, pg[5], HONEST, 3, checksum=state.checksum)
    assert state.fragments[0].step(poll_s=0) is None, "round 3 closed without a"
    push_tokens(state, a, pg[6], HONEST, 3, checksum=state.checksum)
    assert [c.island_id for c in state.fragments[0].step(poll_s=0).summary.contributions] == [a, b]
    # On time again, b is waited for: round 4 does not close on a's push alone until its deadline.
    push_tokens(state, a, pg[7], HONEST, 4, checksum=state.checksum)
    assert state.fragments[0].step(poll_s=0) is None, "round 4 did not wait for b, on time in round 3"
    clock.now += 31
    assert [c.island_id for c in state.fragments[0].step(poll_s=0).summary.contributions] == [a]


@pytest.mark.unit
def test_the_time_box_counts_per_fragment_and_not_the_time_blocked_on_a_result():
    cfg = tiny_config("inner.steps_per_round=4", "inner.max_steps=40", "rounds.mode='time'", "rounds.round_s=1.0",
                      "streaming.fragments=2", "model.n_layers=2")
    clock, blocked = Clock(0.0), [0.0]
    pace = RoundPace(cfg, blocked=lambda: blocked[0], clock=clock)
    pace.begin_round(0)
    pace.begin_round(1)
    clock.now = 0.6
    # Fragment 1 (o_1 = 2 of H = 4) ends its first round after half the box, fragment 0 after the whole one.
    assert pace.due(3, pace.elapsed(1), 1) and not pace.due(3, pace.elapsed(0), 0)
    pace.synced(1)
    pace.begin_round(1)
    blocked[0], clock.now = 5.0, 5.9  # 5 s blocked on a landing inside the round: not counted
    assert abs(pace.elapsed(0) - 0.9) < 1e-9 and abs(pace.elapsed(1) - (5.9 - 0.6 - 5.0)) < 1e-9
    assert not pace.due(30, pace.elapsed(0), 0) and not pace.due(30, pace.elapsed(1), 1)
    clock.now = 6.1
    assert pace.due(30, pace.elapsed(0), 0) and pace.due(40, 0.0, 1)  # the box, and inner.max_steps whatever the time
    # A healing replica group adopts the clocks of the group it heals from.
    other = RoundPace(cfg, blocked=lambda: 0.0, clock=Clock(100.0))
    other.load_state_dict(pace.state_dict())
    assert [round(other.elapsed(f), 9) for f in (0, 1)] == [round(pace.elapsed(f), 9) for f in (0, 1)] and other.first == [True, False]


@pytest.mark.integration
def test_time_boxed_streaming_with_overlap_keeps_every_fragment_equal(make_coordinator):
    """P = 2 fragments, tau = 1, time-boxed 0.6 s rounds: the throttled island (0.25 s a step) does fewer steps; each
    fragment's pushes carry their own tokens; both islands end on the coordinator's parameters, fragment by fragment."""
    cfg = tiny_config("model.n_layers=2", "streaming.fragments=2", "streaming.tau=1", "inner.steps_per_round=4",
                      "rounds.rounds=4", "rounds.mode='time'", "rounds.round_s=0.6", "inner.max_steps=12", "rounds.lease_s=600",
                      "rounds.deadline_s=120")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    with islands_on_threads(coordinator, cfg, [ReplicaSpec(), ReplicaSpec(throttle_s=0.25)]) as ((fast, slow), results):
        pass
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    for f in (0, 1):
        summaries = [s for s in state.summaries if s.fragment == f]
        assert [s.round for s in summaries] == [0, 1, 2, 3], f"fragment {f}"
        tokens = {(s.round, c.island_id): c.tokens for s in summaries for c in s.contributions}
        assert all(t % per_step == 0 and t > 0 for t in tokens.values())
        assert sum(tokens[(r, fast.island_id)] for r in range(4)) > sum(tokens[(r, slow.island_id)] for r in range(4))
    assert results[0].inner_steps > results[1].inner_steps
    assert all(r.checksum_matches for r in results.values()), [(r.checksum, r.inner_steps) for r in results.values()]
    for island in (fast, slow):
        assert island.ctx.state.checksums == [f.checksum for f in state.fragments]
