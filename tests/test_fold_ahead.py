"""Folding ahead of the close (coordinator/rounds.py FoldAhead) on the round state machine, with an injected clock.

The driver folds each complete contribution that comes next in canonical order
while the round is still open; the close keeps those folds only when its
contributions start with exactly them, on time and kept whole by the norm
guard, and else folds the round from the spools. Either way the global
parameters must be bit for bit those of folding everything at the close.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import random_like
from kit import SHARES, Clock, join_shares, make_state, push_share, share_tokens

pytestmark = pytest.mark.unit


def _run(tmp_path, order, step_between: bool, codec: str = "fp32", scale: dict[str, float] | None = None, *overrides: str):
    """Two rounds of three islands pushing in `order`; with step_between the driver steps after each push (folding
    ahead what it can). Returns the parameters, checksum and each round's folded_ahead."""
    state = make_state(tmp_path, "rounds.rounds=2", f"wire.codec='{codec}'", "outer.lr=0.7", "outer.momentum=0.9", *overrides)
    join_shares(state)
    ahead = []
    for round_ in range(2):
        for k, island_id in enumerate(order):
            pg = random_like(state.manifest.shapes, 10 * round_ + int(island_id[-1]))
            if scale:
                pg = {n: t * scale.get(island_id, 1.0) for n, t in pg.items()}
            assert push_share(state, island_id, pg, round_).contribution_complete
            if step_between and k < len(order) - 1:
                assert state.fragments[0].step(poll_s=0) is None, "the round closed before every island pushed"
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None and closed.summary.tokens == share_tokens(state)
        assert closed.summary.elements_folded == closed.summary.elements_expected
        ahead.append(closed.summary.folded_ahead)
    blocks = state.fragments[0].ctx.spools.pool.allocated
    return {n: t.clone() for n, t in state.params.items()}, state.checksum, ahead, blocks


def _expected_ahead(order) -> int:
    """One fold ahead per driver step between pushes, while the next island in canonical order has pushed."""
    canonical, folded = sorted(order), 0
    for k in range(1, len(order)):
        if folded < len(canonical) and canonical[folded] in order[:k]:
            folded += 1
    return folded


def _assert_same(a, b, what):
    assert a[1] == b[1], what
    for name, t in a[0].items():
        assert torch.equal(t, b[0][name]), (what, name)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_folding_ahead_gives_the_close_fold_bit_for_bit_in_every_arrival_order(tmp_path, codec):
    reference = _run(tmp_path, tuple(SHARES), step_between=False, codec=codec)
    assert reference[2] == [0, 0]  # nothing was folded before the close
    seen = set()
    for order in itertools.permutations(SHARES):
        result = _run(tmp_path, order, step_between=True, codec=codec)
        _assert_same(result, reference, f"arrival order {order}")
        assert result[2] == [_expected_ahead(order)] * 2, order
        seen.add(result[2][0])
    assert seen == {0, 1, 2}  # the orders covered no fold ahead, one, and all but the last


def test_a_contribution_folded_ahead_that_the_guard_clips_makes_the_close_start_over(tmp_path):
    """island-0 pushes first with a pseudo-gradient 100x the others': folded ahead at factor 1, then clipped."""
    scale = {"island-0": 100.0}
    reference = _run(tmp_path, tuple(SHARES), False, "fp32", scale)
    result = _run(tmp_path, tuple(SHARES), True, "fp32", scale)
    assert result[2] == [0, 0]  # what was folded ahead was not kept
    _assert_same(result, reference, "clipped after folding ahead")
    unclipped = _run(tmp_path, tuple(SHARES), True, "fp32", scale, "robust.enabled=false")
    assert unclipped[2] == [2, 2] and unclipped[1] != reference[1]  # the guard did change this round


def test_an_earlier_island_contributing_after_a_later_one_was_folded_ahead_makes_the_close_start_over(tmp_path):
    """island-0 sat out two rounds and is back on probation (no round waits for it), so island-1 is folded ahead as
    the first; then island-0 pushes on time after all, and comes first in the round's canonical order."""

    def run(step_between: bool):
        clock = Clock()
        state = make_state(tmp_path, "rounds.rounds=3", "rounds.min_islands=1", "rounds.deadline_s=1", "rounds.lease_s=100000",
                           "limits.idle_rounds=2", clock=clock)
        join_shares(state)
        idler, *workers = SHARES
        assert idler == "island-0"
        for round_ in range(2):
            for w in workers:
                push_share(state, w, random_like(state.manifest.shapes, 10 * round_ + int(w[-1])), round_)
            clock.now += 2  # past the deadline: the round stops waiting for the idler
            assert state.fragments[0].step(poll_s=0) is not None
        assert idler not in state.islands
        state.join("test", island_id=idler, ranks=SHARES[idler][1])
        assert state.islands[idler].probation
        push_share(state, workers[0], random_like(state.manifest.shapes, 21), 2)
        if step_between:
            assert state.fragments[0].step(poll_s=0) is None and len(state.fragments[0].ahead.done) == 1
        push_share(state, idler, random_like(state.manifest.shapes, 20), 2)
        push_share(state, workers[1], random_like(state.manifest.shapes, 22), 2)
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None and list(closed.summary.islands) == ["island-0", "island-1", "island-2"]
        return {n: t.clone() for n, t in state.params.items()}, state.checksum, [closed.summary.folded_ahead]

    reference, result = run(False), run(True)
    assert result[2] == [0]
    _assert_same(result, reference, "an earlier island came back")


@pytest.mark.parametrize("codec", ["fp32", "e3m0"])
def test_a_fold_from_the_memory_pool_on_many_threads_is_the_fold_from_disk(tmp_path, codec):
    """With the pushes in the spool's memory pool, each contribution's chunks are decoded and added on several threads;
    every arrival order, folded ahead or at the close, gives the bits of folding from disk on the driver's thread."""
    reference = _run(tmp_path, tuple(SHARES), False, codec, None, "limits.spool_memory_models=0")
    assert reference[3] == 0  # on disk
    for order in itertools.permutations(SHARES):
        for step_between in (False, True):
            result = _run(tmp_path, order, step_between, codec, None, "limits.spool_memory_models=1000")
            assert result[3] > 1  # in memory, in more than one block
            _assert_same(result, reference, f"arrival order {order}, folded ahead: {step_between}")
