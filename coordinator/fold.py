"""Folding a closed round's contributions into the mean, through the norm guard (diloco/robust.py).

Each contribution's norm is summed chunk by chunk as its pushes arrive
(Codec.sumsq, with the finiteness check), so at the close the guard judges the whole round before anything
is folded, and every contribution is decoded once: folded in canonical island
order with its token weight (discounted when late) times the guard's factor (1
kept, < 1 clipped); a dropped one is not folded at all. With split_late
(rounds.late_mode = "delayed_nesterov") the late ones go to the accumulator's late
part, over the same total weight (diloco/outer.py: delayed Nesterov).
"""

from __future__ import annotations

import math

from coordinator.records import Contribution, fold_key
from diloco.codec import Codec
from diloco.outer import PseudoGradientAccumulator
from diloco.robust import NormGuard, Verdict


def judge(guard: NormGuard, contributions: list[tuple[str, Contribution]], label: str) -> Verdict:
    """The guard's verdict on norms per unit of inner learning rate (comparable across warmup and a
    fragment's shorter first round); contributions trained on no tokens (zero weight) are not judged."""
    return guard.judge({fold_key(island, c): math.sqrt(c.sumsq) / c.lr_sum for island, c in contributions if c.tokens}, label)


def fold(accumulator: PseudoGradientAccumulator, codec: Codec, contributions: list[tuple[str, Contribution]],
         verdict: Verdict, numel: int, split_late: bool = False) -> int:
    """Folds the kept contributions in the given (canonical) order; returns the elements folded. split_late: late
    contributions go to the accumulator's late part (PseudoGradientAccumulator.parts())."""
    folded = 0
    for island, contribution in contributions:
        late = split_late and contribution.staleness > 0
        factor = verdict.factors.get(fold_key(island, contribution), 1.0)
        if factor == 0.0:
            for spool in contribution.spools:
                spool.discard()
            continue
        # Token-weighted; a late contribution's weight carries its staleness discount (coordinator/records.py).
        scale = accumulator.scale_for(contribution.weight) * factor
        elements = 0
        for k, spool in enumerate(contribution.spools):
            # Each push stream in the codec it came in (compression per link), else the run's.
            decoder = contribution.codecs[k] if k < len(contribution.codecs) else codec
            for chunk in spool.read():  # verified on arrival; the spool checks its own digests
                accumulator.add_chunk(chunk.name, chunk.offset, decoder.decode_view(chunk.payload, chunk.numel), scale, late)
                elements += chunk.numel
            spool.discard()
        # Coverage proved exactly-once already; this is the invariant the summary reports.
        assert elements == numel, (elements, numel)
        accumulator.commit(contribution.weight, late)
        folded += elements
    if not accumulator.contributions:  # every contribution dropped: the round's mean is zero
        accumulator.commit(0)
    return folded
