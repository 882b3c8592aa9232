"""rounds.late_mode: late contributions folded into the round's mean ("discount") or by delayed Nesterov.

The delayed Nesterov arithmetic (diloco/outer.py) is checked against the same equations
written out here in plain torch, through the coordinator's own close, fold and step, over
rounds with on-time and late contributions of unequal tokens and one round whose only
weight is late; without late contributions both modes give torch's SGD bit for bit; a
coordinator restarted from a checkpoint mid-run carries on bit for bit; and a real island
whose push comes late ends on the coordinator's parameters.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_like, tiny_config
from kit import NESTEROV, T, Clock, Reference, join_all, late_island_run, make_state, push_tokens
from coordinator import durable
from coordinator.server import initial_parameters
from diloco.checkpoint import CheckpointStore
from diloco.config import ConfigError
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator

DELAYED = "rounds.late_mode='delayed_nesterov'"
# robust.first_quorum 1: these runs close round 0 at its deadline with one island, the others' pushes coming late.
LATE = ("rounds.late_rounds=2", "rounds.late_discount=0.5", "rounds.deadline_s=30", "rounds.lease_s=10000",
        "limits.idle_rounds=0", "robust.first_quorum=1")


class DelayedReference:
    """Delayed Nesterov written out: A and B each over the round's whole weight, as the accumulator forms them (a
    contribution scaled by its weight over the first positive one's, the sums divided by the total over that one);
    m_r = (mu m_{r-1} + B_{r-1}) + A_r (m_0 = A_0); theta -= lr (A_r + mu m_r); theta -= lr B_r."""

    def __init__(self, cfg):
        self.params = {n: t.clone() for n, t in initial_parameters(cfg).items()}
        self.lr, self.mu, self.nesterov = cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov
        self.m: dict[str, torch.Tensor] | None = None
        self.b_prev: dict[str, torch.Tensor] | None = None

    def round(self, on_time: list[tuple[float, dict]], late: list[tuple[float, dict]] = ()) -> None:
        weights, ref, scales = [w for w, _ in [*on_time, *late]], None, []
        for w in weights:
            scales.append(w / (ref or w) if w else 0.0)
            ref = ref if ref is not None or w <= 0 else w
        total = sum(weights)
        divisor = total / ref if total else 1.0

        def part(items, item_scales) -> dict[str, torch.Tensor]:
            out = {n: torch.zeros_like(p) for n, p in self.params.items()}
            for (_, pg), s in zip(items, item_scales):
                for n in out:
                    out[n].add_(pg[n], alpha=s)
            return {n: t.div(divisor) if divisor != 1.0 else t for n, t in out.items()}

        a, b = part(on_time, scales[:len(on_time)]), part(late, scales[len(on_time):]) if late else None
        m = {}
        for n, p in self.params.items():
            if self.m is None:
                m[n] = a[n].clone()
            else:
                m[n] = self.m[n] * self.mu
                if self.b_prev is not None:
                    m[n] = m[n] + self.b_prev[n]
                m[n] = m[n] + a[n]
            p.add_(a[n].add(m[n], alpha=self.mu) if self.nesterov else m[n], alpha=-self.lr)
            if b is not None:
                p.add_(b[n], alpha=-self.lr)
        self.m, self.b_prev = m, b

    def matches(self, state) -> bool:
        return all(torch.equal(state.params[n], t) for n, t in self.params.items())


def _close(state, clock: Clock):
    """Closes the open round at its deadline (late pushes may still come for it); returns the summary."""
    clock.now += 31
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None
    return closed.summary


@pytest.mark.unit
def test_delayed_nesterov_matches_the_written_out_equations(tmp_path):
    """Five rounds: two islands late into round 1 (different tokens and weights), none late in round 2, a round whose
    only weight is late (its on-time push trained on no tokens) and one after it (the late part joins the momentum)."""
    clock = Clock()
    state = make_state(tmp_path, *NESTEROV, "rounds.rounds=5", DELAYED, *LATE, clock=clock)
    a, b, c = join_all(state, "abc")
    shapes, reference = state.manifest.shapes, DelayedReference(state.cfg)
    pg = {k: random_like(shapes, 100 + k) for k in range(12)}
    start = [state.checksum]

    push_tokens(state, a, pg[0], T, 0)
    _close(state, clock)
    reference.round([(T, pg[0])])
    assert reference.matches(state), "round 0: the first step is torch's"
    start.append(state.checksum)

    assert push_tokens(state, b, pg[1], 2 * T, 0, checksum=start[0]).late
    assert push_tokens(state, c, pg[2], 3 * T, 0, checksum=start[0]).late
    push_tokens(state, a, pg[3], 3 * T, 1)
    summary = _close(state, clock)
    assert [(i.island_id, i.staleness, i.weight) for i in summary.contributions] == [
        (a, 0, 3 * T), (b, 1, T), (c, 1, 3 * T / 2)]
    reference.round([(3 * T, pg[3])], [(float(T), pg[1]), (3 * T / 2, pg[2])])
    assert reference.matches(state), "round 1: the late part was not applied momentum-free at its share"
    assert state.fragments[0].outer.carry, "the late part is carried into the next round's momentum"
    start.append(state.checksum)

    push_tokens(state, a, pg[4], T, 2)
    push_tokens(state, b, pg[5], 2 * T, 2)
    _close(state, clock)
    reference.round([(T, pg[4]), (2 * T, pg[5])])
    assert reference.matches(state), "round 2: round 1's late part did not join the momentum"
    start.append(state.checksum)

    push_tokens(state, a, pg[6], 0, 3)  # trained on nothing: the round's only weight is c's, two rounds late
    assert push_tokens(state, c, pg[7], T, 1, checksum=start[1]).late
    summary = _close(state, clock)
    assert [(i.island_id, i.staleness, i.weight) for i in summary.contributions] == [(a, 0, 0.0), (c, 2, T / 4)]
    reference.round([(0, pg[6])], [(T / 4, pg[7])])
    assert reference.matches(state), "round 3: a round of late weight only"

    push_tokens(state, a, pg[8], T, 4)
    push_tokens(state, c, pg[9], 2 * T, 4)
    summary = _close(state, clock)
    reference.round([(T, pg[8]), (2 * T, pg[9])])
    assert reference.matches(state) and summary.elements_folded == 2 * state.manifest.total_numel()
    assert state.events.late_folded == 3


@pytest.mark.unit
def test_a_round_of_late_contributions_only():
    """The accumulator and the optimizer alone: no on-time weight at all, A is zero and B the weighted mean."""
    shapes = {"w": (3, 4), "b": (4,)}
    params = {n: torch.zeros(s) for n, s in shapes.items()}
    acc, outer = PseudoGradientAccumulator(shapes), OuterOptimizer(params, tiny_config("outer.momentum=0.9").outer)
    x, y = random_like(shapes, 1), random_like(shapes, 2)
    for w, pg in ((500.0, x), (1500.0, y)):
        for n, t in pg.items():
            acc.add_chunk(n, 0, t.reshape(-1), acc.scale_for(w), late=True)
        acc.commit(w, late=True)
    on_time, late = acc.parts()
    assert all(not t.any() for t in on_time.values())
    assert all(torch.equal(late[n], torch.zeros(shapes[n]).add_(x[n]).add_(y[n], alpha=3.0).div_(4.0)) for n in shapes)
    outer.step_delayed(on_time, late)
    assert all(torch.equal(params[n], late[n] * -0.7) for n in shapes), "momentum-free: theta -= lr B"
    acc.reset()
    assert acc.late_contributions == 0 and all(not t.any() for t in acc.late_sums.values())
    with pytest.raises(RuntimeError, match="step_delayed"):
        outer.step(on_time)


@pytest.mark.unit
@pytest.mark.parametrize("nesterov", ["true", "false"])
def test_without_late_contributions_both_modes_are_torch_sgd_bit_for_bit(tmp_path, nesterov):
    clock = Clock()
    states = [make_state(tmp_path, *NESTEROV, "rounds.rounds=4", f"outer.nesterov={nesterov}", mode, clock=clock)
              for mode in ("rounds.late_mode='discount'", DELAYED)]
    ids = [join_all(s, "ab") for s in states]
    cfg = states[0].cfg
    reference = Reference(cfg)
    reference.opt.param_groups[0]["nesterov"] = cfg.outer.nesterov
    for round_ in range(4):
        pgs = [random_like(states[0].manifest.shapes, 10 * round_ + i) for i in range(2)]
        tokens = [T * (round_ + 1), 3 * T]
        for state, (a, b) in zip(states, ids):
            push_tokens(state, a, pgs[0], tokens[0], round_)
            push_tokens(state, b, pgs[1], tokens[1], round_)
            assert state.fragments[0].step(poll_s=0) is not None
        reference.round(list(zip(tokens, pgs)))
        assert all(torch.equal(states[0].params[n], t) for n, t in states[1].params.items()), f"round {round_}"
        assert states[0].checksum == states[1].checksum and reference.matches(states[1])


def _checkpoint_round_trip(tmp_path, clock, store, overrides, rounds):
    """A coordinator saved after round 1 and one restored from it take the same pushes for rounds 2..rounds-1."""
    state = make_state(tmp_path, *NESTEROV, f"rounds.rounds={rounds}", *overrides, clock=clock)
    a, b = join_all(state, "ab")
    pg = {k: random_like(state.manifest.shapes, 200 + k) for k in range(20)}
    start = [state.checksum]
    push_tokens(state, a, pg[0], T, 0)
    _close(state, clock)
    start.append(state.checksum)
    push_tokens(state, b, pg[1], 3 * T, 0, checksum=start[0])  # late into round 1 (discount runs refuse nothing either)
    push_tokens(state, a, pg[2], 2 * T, 1)
    _close(state, clock)
    durable.save(state, store)
    return state, (a, b), pg


@pytest.mark.unit
def test_a_restart_from_a_checkpoint_carries_on_bit_for_bit(tmp_path):
    """Saved after a round with a late contribution (its late part still owed to the momentum), restored into a new
    coordinator: both take the same pushes, on time and late, and stay equal bit for bit."""
    clock = Clock()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    state, (a, b), pg = _checkpoint_round_trip(tmp_path, clock, store, (DELAYED, *LATE), 5)
    assert state.fragments[0].outer.carry
    restored = make_state(tmp_path, *NESTEROV, "rounds.rounds=5", DELAYED, *LATE, clock=clock)
    assert durable.restore(restored, store) and restored.round == 2 and restored.checksum == state.checksum
    assert all(torch.equal(restored.fragments[0].outer.carry[n], t) for n, t in state.fragments[0].outer.carry.items())
    round_2 = state.checksum  # what b trains round 2 from: its push comes late, into round 3
    for round_ in range(2, 5):
        for s in (state, restored):
            push_tokens(s, a, pg[3 * round_], T + T // 2 * round_, round_)
            if round_ == 3:
                assert push_tokens(s, b, pg[3 * round_ + 1], 2 * T, 2, checksum=round_2).late
            _close(s, clock)
        assert all(torch.equal(state.params[n], t) for n, t in restored.params.items()), f"round {round_}"
        assert state.checksum == restored.checksum
    assert state.events.late_folded == 2 and restored.summaries[-2].contributions[-1].staleness == 1
    # Its carried momentum holds the late part: a "discount" run cannot take it up.
    with pytest.raises(ValueError, match="late_mode"):
        durable.restore(make_state(tmp_path, *NESTEROV, "rounds.rounds=5", *LATE, clock=clock), store)


@pytest.mark.unit
def test_a_discount_checkpoint_resumed_with_delayed_nesterov_continues_exactly(tmp_path):
    """Torch's momentum buffer is taken up as it stands: with on-time pushes only, the switched run is the run."""
    clock = Clock()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    state, (a, b), pg = _checkpoint_round_trip(tmp_path, clock, store, LATE, 4)
    restored = make_state(tmp_path, *NESTEROV, "rounds.rounds=4", DELAYED, *LATE, clock=clock)
    assert durable.restore(restored, store)
    for round_ in (2, 3):
        for s in (state, restored):
            push_tokens(s, a, pg[10 + round_], T, round_)
            push_tokens(s, b, pg[15 + round_], 2 * T, round_)
            _close(s, clock)
        assert all(torch.equal(state.params[n], t) for n, t in restored.params.items()), f"round {round_}"


@pytest.mark.unit
def test_late_mode_is_checked():
    with pytest.raises(ConfigError, match="late_mode"):
        tiny_config("rounds.late_mode='nesterov'")
    assert tiny_config(DELAYED).digest() == tiny_config().digest()  # the coordinator's business, not the islands'


@pytest.mark.integration
def test_a_real_island_folded_late_with_delayed_nesterov_ends_on_the_coordinators_parameters(make_coordinator):
    """The late-push scenario (tests/kit.py late_island_run, as tests/test_heterogeneous.py runs it) in this mode: the
    island's round-0 push is held until round 0 closed (folded late into round 1), its round-2 push until round 4 is
    open (refused); every copy ends equal."""
    state, _, island, result = late_island_run(make_coordinator, DELAYED)
    by_round = {s.round: s for s in state.summaries}
    assert (island.island_id, 1) in [(c.island_id, c.staleness) for c in by_round[1].contributions]
    assert state.events.late_folded == 1 and state.events.late_pushes == 1 and result.late_folds == 1
    assert state.fragments[0].outer.carry, "the round's late part went through the delayed step"
    assert result.checksum_matches and result.checksum == state.checksum
