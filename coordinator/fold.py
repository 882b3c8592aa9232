"""Folding a closed round's contributions into the mean, through the norm guard (diloco/robust.py).

Each contribution's norm is summed chunk by chunk as its pushes arrive
(Codec.sumsq, with the finiteness check), so at the close the guard judges the whole round before anything
is folded, and every contribution is decoded once: folded in canonical island
order with its token weight (discounted when late) times the guard's factor (1
kept, < 1 clipped); a dropped one is not folded at all. With split_late
(rounds.late_mode = "delayed_nesterov") the late ones go to the accumulator's late
part, over the same total weight (diloco/outer.py: delayed Nesterov).

Folding ahead (FoldAhead): while a round is still open, the round driver folds
each complete contribution that comes next in canonical order among the islands
that may still contribute on time, so a round whose islands finish pushing at
different times closes with one fold on its critical path instead of one per
island. These are exactly the operations fold() would do at the close, in the
same order, so the close keeps them when its contributions start with the same
ones, on time and kept whole by the guard; otherwise it resets the accumulator
and folds everything from the spools, which stay until the close.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import Executor, wait

from coordinator.membership import canonical_order
from coordinator.records import Contribution, fold_key
from coordinator.spool import SpoolCorrupt, SpooledChunk
from diloco.codec import Codec
from diloco.outer import PseudoGradientAccumulator
from diloco.robust import NormGuard, Verdict

log = logging.getLogger(__name__)


def judge(guard: NormGuard, contributions: list[tuple[str, Contribution]], label: str) -> Verdict:
    """The guard's verdict on norms per unit of inner learning rate (comparable across warmup and a
    fragment's shorter first round) and on directions (the sketches made at intake); contributions trained on no
    tokens (zero weight) are not judged."""
    judged = [(fold_key(island, c), c) for island, c in contributions if c.tokens]
    return guard.judge({key: math.sqrt(c.sumsq) / c.lr_sum for key, c in judged}, label,
                       {key: c.sketch for key, c in judged if c.sketched and c.sketch is not None})


def fold(accumulator: PseudoGradientAccumulator, codec: Codec, contributions: list[tuple[str, Contribution]],
         verdict: Verdict, numel: int, split_late: bool = False, pool: Executor | None = None) -> int:
    """Folds the kept contributions in the given (canonical) order; returns the elements folded. split_late: late
    contributions go to the accumulator's late part (PseudoGradientAccumulator.parts()). pool: threads that decode
    and add a contribution's chunks at once (each element still gets the contributions in canonical order)."""
    folded = 0
    for island, contribution in contributions:
        late = split_late and contribution.staleness > 0
        factor = verdict.factors.get(fold_key(island, contribution), 1.0)
        if factor == 0.0:
            for spool in contribution.spools:
                spool.discard()
            continue
        _fold_one(accumulator, codec, contribution, factor, numel, late, pool)
        for spool in contribution.spools:
            spool.discard()
        folded += numel
    if not accumulator.contributions:  # every contribution dropped: the round's mean is zero
        accumulator.commit(0)
    return folded


def _fold_one(accumulator: PseudoGradientAccumulator, codec: Codec, contribution: Contribution, factor: float, numel: int,
              late: bool, pool: Executor | None = None) -> None:
    # Token-weighted; a late contribution's weight carries its staleness discount (coordinator/records.py).
    scale = accumulator.scale_for(contribution.weight) * factor
    accumulator.part(late)  # allocated here, not by one of the threads
    elements, pending = 0, []

    def add(chunk: SpooledChunk, decoder: Codec) -> None:
        accumulator.add_encoded(chunk.name, chunk.offset, chunk.numel, chunk.payload, decoder, scale, late)

    try:
        for k, spool in enumerate(contribution.spools):
            # Each push stream in the codec it came in (compression per link), else the run's.
            decoder = contribution.codecs[k] if k < len(contribution.codecs) else codec
            for chunk in spool.read():  # verified on arrival; the spool checks its own digests
                if pool is not None and chunk.stable:  # the codecs' kernels and torch's add release the GIL
                    pending.append(pool.submit(add, chunk, decoder))
                else:  # read from disk into a buffer the next chunk reuses
                    add(chunk, decoder)
                elements += chunk.numel
    finally:
        wait(pending)  # every chunk of this contribution is in before the next contribution's
    for done in pending:
        done.result()
    # Coverage proved exactly-once already; this is the invariant the summary reports.
    assert elements == numel, (elements, numel)
    accumulator.commit(contribution.weight, late)


class FoldAhead:
    """The contributions of the open round folded already, in canonical order (module docstring)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, Contribution]] = []
        self.broken = False  # a fold ahead failed part-way: the close starts over

    def reset(self) -> None:
        self.done, self.broken = [], False

    def next(self, contributions: dict[str, Contribution], waited_for: list[str]) -> tuple[str, Contribution] | None:
        """The contribution to fold now, if the one next in canonical order among the islands that may still contribute
        on time is complete. Caller holds the round's condition."""
        if self.broken:
            return None
        order = canonical_order(set(waited_for) | set(contributions))
        n = len(self.done)
        if n >= len(order) or [i for i, _ in self.done] != order[:n]:
            return None  # an island before those folded came back: the close will fold from the spools
        island = order[n]
        contribution = contributions.get(island)
        if contribution is None or contribution.state != "complete" or not contribution.tokens:
            return None
        return island, contribution

    def fold(self, accumulator: PseudoGradientAccumulator, codec: Codec, island: str, contribution: Contribution,
             numel: int, pool: Executor | None = None) -> None:
        """Folds one contribution as fold() would (factor 1, on time); its spools stay for a close that starts over."""
        try:
            _fold_one(accumulator, codec, contribution, 1.0, numel, False, pool)
        except (OSError, SpoolCorrupt) as e:  # dropped meanwhile (spool gone), or the disk: the close decides
            log.warning("folding %s ahead of the close failed (%s); the close folds the round from the spools", island, e)
            self.broken = True
            return
        self.done.append((island, contribution))

    def take(self, accumulator: PseudoGradientAccumulator, contributions: list[tuple[str, Contribution]], verdict: Verdict) -> int:
        """How many of the closing round's first contributions the accumulator holds, folded exactly as fold() would
        fold them; when it holds anything else, resets it and returns 0."""
        n = len(self.done)
        kept = not self.broken and n <= len(contributions) and all(
            island == contributions[k][0] and contribution is contributions[k][1] and not contribution.staleness
            and verdict.factors.get(fold_key(island, contribution), 1.0) == 1.0
            for k, (island, contribution) in enumerate(self.done))
        self.reset()
        if kept:
            return n
        if n:
            log.info("a round's contributions were not those folded ahead of its close; folding it from the spools")
        accumulator.reset()
        return 0
