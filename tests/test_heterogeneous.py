"""Islands that differ: unequal contributions, late contributions, time-boxed rounds, an island's own H.

The coordinator's arithmetic is checked against the same operations written out
here (a late push folded with its staleness discount, unequal token weights);
real islands on threads of this process run the protocol's cases: a late push
folded into the next round, one later than rounds.late_rounds refused and the
island back in a later round, a time-boxed run where one island is throttled.
Every wait is on an event with a generous bound.
"""

from __future__ import annotations


import pytest
import torch

from conftest import random_like, tiny_config
from kit import NESTEROV, T, Clock, Reference, islands_on_threads, join_all, late_island_run, make_state, push_tokens, refusal
from coordinator.links import LinkAdvisor
from diloco.config import ConfigError, load_config
from diloco.pace import lr_position
from diloco.wire.refusal import Reason
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import link_codecs
from islands.round import PaceError, RoundPace
from islands.state import ReplicaSpec


@pytest.mark.unit
def test_unequal_contributions_are_weighted_by_tokens_exactly(tmp_path):
    """Two islands of different speeds (one trains twice the steps: twice the tokens); claims up to inner.max_steps."""
    clock = Clock()
    state = make_state(tmp_path, *NESTEROV, "rounds.rounds=2", "inner.max_steps=4",
                       clock=clock)
    a, b = state.join("a").island_id, state.join("b").island_id
    per_step = state.cfg.inner.batch_size * state.cfg.data.seq_len
    reference = Reference(state.cfg)
    for round_ in range(2):
        pa, pb_ = random_like(state.manifest.shapes, 10 * round_), random_like(state.manifest.shapes, 10 * round_ + 1)
        push_tokens(state, a, pa, 2 * per_step, round_, steps=2)
        push_tokens(state, b, pb_, 4 * per_step, round_, steps=4)  # its own H = 4 > the run's 2: within inner.max_steps
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None
        assert [(c.island_id, c.tokens, c.weight) for c in closed.summary.contributions] == [
            (a, 2 * per_step, 2 * per_step), (b, 4 * per_step, 4 * per_step)]
        reference.round([(2 * per_step, pa), (4 * per_step, pb_)])
        assert reference.matches(state), f"round {round_}: not the token-weighted mean"
    # More steps than inner.max_steps is more than any island trains in a round: refused.
    r = refusal(lambda: push_tokens(state, a, random_like(state.manifest.shapes, 3), 5 * per_step, 2, steps=5))
    assert r.reason == Reason.BAD_REQUEST


@pytest.mark.unit
def test_a_late_push_is_folded_with_its_discount_and_one_later_than_k_is_refused(tmp_path):
    clock = Clock()
    # robust.first_quorum 1: round 0 closes at its deadline with a alone (b's push comes late).
    state = make_state(tmp_path, *NESTEROV, "rounds.rounds=4", "rounds.late_rounds=1", "rounds.late_discount=0.5",
                       "rounds.deadline_s=30", "rounds.lease_s=10000", "limits.idle_rounds=0", "robust.first_quorum=1",
                       clock=clock)
    a, b, c = join_all(state, "abc")
    shapes, reference = state.manifest.shapes, Reference(state.cfg)
    start = [state.checksum]

    def close_at_deadline() -> pb.RoundSummary:
        assert state.fragments[0].step(poll_s=0) is None, "closed before its deadline"
        clock.now += 31
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None
        start.append(state.checksum)
        return closed.summary

    # Round 0 closes at its deadline with a alone; b's push for it arrives after: folded into round 1 at half weight.
    pg = {k: random_like(shapes, k) for k in range(8)}
    push_tokens(state, a, pg[0], T, 0)
    close_at_deadline()
    reference.round([(T, pg[0])])
    late = push_tokens(state, b, pg[1], T, 0, checksum=start[0])
    assert late.late and late.folded_into == 1 and late.contribution_complete
    # b trained from round 0's parameters: a late push claiming round 1's is refused.
    assert refusal(lambda: push_tokens(state, c, pg[2], T, 0, checksum=start[1])).reason == Reason.CHECKSUM_MISMATCH
    push_tokens(state, a, pg[3], T, 1)
    summary = close_at_deadline()
    assert [(i.island_id, i.staleness, i.weight) for i in summary.contributions] == [(a, 0, T), (b, 1, T / 2)]
    reference.round([(T, pg[3]), (T / 2, pg[1])])
    assert reference.matches(state), "round 1: the late push was not folded with its discount"
    assert state.events.late_folded == 1

    # Round 2: b's contribution is half pushed when the round closes: the rest arrives late and folds into round 3.
    push_tokens(state, a, pg[4], T, 2)
    push_tokens(state, b, pg[5], 3 * T, 2, chunks=slice(0, 2))
    summary = close_at_deadline()
    assert [i.island_id for i in summary.contributions] == [a]
    reference.round([(T, pg[4])])
    rest = push_tokens(state, b, pg[5], 3 * T, 2, chunks=slice(2, None))
    assert rest.late and rest.folded_into == 3 and rest.contribution_complete
    # c's push for round 1 is 2 rounds late (rounds.late_rounds = 1): refused, naming the current round.
    r = refusal(lambda: push_tokens(state, c, pg[6], T, 1, checksum=start[1]))
    assert r.reason == Reason.ROUND_CLOSED and r.current_round == 3 and state.events.late_pushes == 1
    push_tokens(state, a, pg[7], T, 3)
    summary = close_at_deadline()
    assert [(i.island_id, i.staleness, i.weight) for i in summary.contributions] == [(a, 0, T), (b, 1, 3 * T / 2)]
    reference.round([(T, pg[7]), (3 * T / 2, pg[5])])
    assert reference.matches(state) and summary.elements_folded == 2 * state.manifest.total_numel()


@pytest.mark.unit
def test_pace_config_and_lr_positions():
    cfg = tiny_config("inner.steps_per_round=4", "inner.max_steps=8", "rounds.mode='time'", "rounds.round_s=1.0")
    # Round 1's steps sit on positions 4..7; a fast island's extra steps stay on the round's last position.
    assert [lr_position(4, j, cfg) for j in range(6)] == [4, 5, 6, 7, 7, 7]
    pace = RoundPace(cfg)
    assert pace.time_boxed and not pace.due(0, 5.0) and pace.due(1, 1.0) and not pace.due(3, 0.5) and pace.due(8, 0.0)
    own = RoundPace(cfg, own_steps=6)  # its own H opts out of the clock
    assert not own.time_boxed and own.due(6, 0.0) and not own.due(5, 100.0)
    with pytest.raises(PaceError):
        RoundPace(cfg, own_steps=9)
    # Streaming: a fragment's first round is (H - o_f) / H of the box, so the syncs stay spread (o_1 = 2 of H = 4).
    two = RoundPace(tiny_config("inner.steps_per_round=4", "rounds.mode='time'", "rounds.round_s=1.0", "streaming.fragments=2",
                               "model.n_layers=2"))
    assert two.due(1, 0.5, 1) and not two.due(1, 0.5, 0) and (two.synced(1) or not two.due(1, 0.5, 1))
    with pytest.raises(ConfigError, match="round_s"):
        load_config(None, ["rounds.mode='time'"])
    # Plain settings hash as before the new knobs existed; a time-boxed run is part of what islands agree on.
    assert tiny_config().digest() == tiny_config("rounds.late_rounds=2").digest()
    assert tiny_config().digest() != tiny_config("rounds.mode='time'", "rounds.round_s=1.0").digest()


# --- real islands on threads of this process -------------------------------------------------


@pytest.mark.integration
def test_an_island_folded_late_carries_on_and_one_later_than_k_is_back_in_a_later_round(make_coordinator):
    """Round 0 closes without the island (its push is held): the push then folds into round 1 and the island trains
    round 1 on time. Its round-2 push is held until round 4 is open: 2 rounds late, refused (ROUND_CLOSED); the
    island resyncs and contributes to round 4. Every copy ends on the coordinator's parameters."""
    state, puppet_id, island, result = late_island_run(make_coordinator)
    cfg = state.cfg
    by_round = {s.round: s for s in state.summaries}
    per_round = cfg.inner.batch_size * cfg.data.seq_len * cfg.inner.steps_per_round
    assert [(c.island_id, c.staleness, c.weight) for c in by_round[1].contributions] == [
        (puppet_id, 0, per_round), (island.island_id, 0, per_round), (island.island_id, 1, per_round * 0.5)]
    assert island.island_id not in by_round[2].islands and island.island_id not in by_round[3].islands
    assert state.events.late_folded == 1 and state.events.late_pushes == 1 and result.late_folds == 1
    # Back in round 4 with H steps' tokens (its step count moved to round 4's start, not 3 rounds' steps in one).
    assert {c.island_id: c.tokens for c in by_round[4].contributions}[island.island_id] == per_round
    assert result.checksum_matches and result.checksum == state.checksum


@pytest.mark.integration
def test_time_boxed_rounds_give_the_fast_island_more_steps(make_coordinator):
    """rounds.mode = "time": the throttled island (1 s a step) fits one step in each 0.9 s round, the other more;
    contributions carry their tokens and both islands end on the coordinator's parameters."""
    cfg = tiny_config("rounds.rounds=3", "rounds.mode='time'", "rounds.round_s=0.9", "inner.max_steps=6", "rounds.lease_s=600",
                      "rounds.deadline_s=120")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    with islands_on_threads(coordinator, cfg, [ReplicaSpec(), ReplicaSpec(throttle_s=1.0)]) as ((fast, slow), results):
        pass
    assert results[1].inner_steps == 3, "the throttled island should fit exactly one step a round"
    assert results[0].inner_steps > results[1].inner_steps
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    tokens = {(s.round, c.island_id): c.tokens for s in state.summaries for c in s.contributions}
    assert all(tokens[(r, slow.island_id)] == per_step for r in range(3))
    assert sum(tokens[(r, fast.island_id)] for r in range(3)) == results[0].inner_steps * per_step
    assert all(r.checksum_matches and r.checksum == state.checksum for r in results.values())


@pytest.mark.integration
def test_an_island_with_its_own_steps_per_round(make_coordinator):
    """--steps-per-round: one island trains 4 steps a round where the run's H is 2; its pushes weigh twice."""
    cfg = tiny_config("rounds.rounds=2", "inner.max_steps=4", "rounds.lease_s=600")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    with islands_on_threads(coordinator, cfg, [ReplicaSpec(), ReplicaSpec(steps_per_round=4)]) as ((plain, own), results):
        pass
    assert [results[0].inner_steps, results[1].inner_steps] == [4, 8]
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    for s in state.summaries:
        assert {c.island_id: c.tokens for c in s.contributions} == {plain.island_id: 2 * per_step, own.island_id: 4 * per_step}
    assert all(r.checksum_matches and r.checksum == state.checksum for r in results.values())


@pytest.mark.unit
def test_the_advised_codec_is_the_least_lossy_that_fits_the_link():
    cfg = tiny_config("wire.link_codecs=['fp32', 'int8', 'e3m0']", "wire.link_fraction=0.1")
    codecs = link_codecs(cfg.wire)
    assert list(codecs) == ["fp32", "int8", "e3m0"]
    advisor = LinkAdvisor(list(codecs.values()), cfg.wire.link_fraction)
    numel, round_s = 1_000_000, 10.0  # a push may take 1 s
    assert advisor.choose(8e6, numel, round_s) == "fp32"  # 4 MB in 0.5 s
    assert advisor.choose(2e6, numel, round_s) == "int8"  # fp32 2 s, int8 ~0.5 s
    assert advisor.choose(0.7e6, numel, round_s) == "e3m0"  # int8 ~1.5 s, e3m0 ~0.74 s
    assert advisor.choose(1e3, numel, round_s) == "e3m0"  # nothing fits: the most compressed
    assert advisor.advise("island-0", 0, 1, numel, round_s) == ""  # no push measured yet: keep your codec
    advisor.observe("island-0", 2_000_000, 1.0)
    assert advisor.advise("island-0", 0, 1, numel, round_s) == "int8"
    advisor.observe("island-0", 100_000_000, 1.0)  # a faster link later: the advice for round 1 stands, round 2 follows
    assert advisor.advise("island-0", 0, 1, numel, round_s) == "int8" and advisor.advise("island-0", 0, 2, numel, round_s) == "fp32"


@pytest.mark.integration
def test_a_codec_switch_mid_run_keeps_every_copy_equal(make_coordinator):
    """wire.link_codecs with a budget no link meets: round 0 is pushed in the run's fp32, then every island is advised
    int8 (with error feedback); the coordinator folds each push in its own codec and every island ends on its
    parameters."""
    cfg = tiny_config("rounds.rounds=3", "wire.link_codecs=['fp32', 'int8']", "wire.link_fraction=1e-9", "wire.error_feedback=true",
                      "rounds.lease_s=600")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    with islands_on_threads(coordinator, cfg, [ReplicaSpec(), ReplicaSpec()]) as (islands, results):
        pass
    codecs = {s.round: {c.codec for c in s.contributions} for s in state.summaries}
    assert codecs == {0: {"fp32"}, 1: {"int8"}, 2: {"int8"}}
    assert all(i.ctx.state.codecs == ["int8"] for i in islands)
    assert all(any(t.abs().sum() > 0 for t in i.ctx.feedback.buffers.values()) for i in islands), "int8 left no residual owed"
    assert all(r.checksum_matches and r.checksum == state.checksum for r in results.values())


@pytest.mark.unit
def test_pushes_in_different_codecs_fold_each_in_its_own(tmp_path):
    """Compression per link: in one round a pushes fp32 and b int8; b's values are what int8 carries."""
    state = make_state(tmp_path, *NESTEROV, "rounds.rounds=1", "wire.link_codecs=['fp32', 'int8']", clock=Clock())
    a, b = join_all(state, "ab")
    int8 = link_codecs(state.cfg.wire)["int8"]
    pa, pb_ = random_like(state.manifest.shapes, 1), random_like(state.manifest.shapes, 2)
    push_tokens(state, a, pa, T, 0)
    push_tokens(state, b, pb_, 3 * T, 0, codec=int8)
    bf16 = link_codecs(tiny_config("wire.codec='bf16'").wire)["bf16"]  # a codec outside the list is still refused
    assert refusal(lambda: push_tokens(state, a, pa, T, 0, codec=bf16)).reason == Reason.CODEC_MISMATCH
    closed = state.fragments[0].step(poll_s=0)
    assert [c.codec for c in closed.summary.contributions] == ["fp32", "int8"]
    carried = {}
    for name, t in pb_.items():  # what int8 delivers, chunk by chunk as the push cut it
        flat = t.reshape(-1)
        step = int8.max_elements(state.cfg.wire.chunk_bytes)
        carried[name] = torch.cat([int8.decode(int8.encode(flat[i:i + step]), flat[i:i + step].numel())
                                   for i in range(0, flat.numel(), step)]).view(t.shape)
    reference = Reference(state.cfg)
    reference.round([(T, pa), (3 * T, carried)])
    assert reference.matches(state)
