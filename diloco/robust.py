"""Robust aggregation: a pseudo-gradient whose norm is an outlier is clipped (or dropped) before the mean.

The norms judged are per unit of inner learning rate (the coordinator divides
each by the sum of the lrs of the steps it was trained with), so warmup and a
fragment's shorter first round do not look like outliers.

A poisoned or broken island can push a finite pseudo-gradient a thousand times
the usual size; folded as it is, one round moves the global parameters far off.
The reference for "usual" is the median norm of the round's other
contributions and of the run's recent rounds (the medians of the last
`history` rounds), so one island alone in a round is still judged, and a
round of several cannot vouch for an outlier among them. A contribution above
`norm_factor` x reference is clipped to the reference norm (its direction
kept, so the round moves no more than an honest one), or dropped. With no
reference yet (the first round with one island) everything is accepted.
Honest DiLoCo pseudo-gradients vary little from island to island and round to
round (the same model, the same H, the same lr schedule), so a factor of 3
leaves them alone (the convergence benchmark's figures are unchanged with it on).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field

from diloco.config import RobustConfig

log = logging.getLogger(__name__)


@dataclass
class Verdict:
    """What the guard decided for one round: a factor per contribution (1 kept, < 1 clipped, 0 dropped)."""

    factors: dict[str, float] = field(default_factory=dict)
    clipped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    reference: float = math.nan


class NormGuard:
    def __init__(self, cfg: RobustConfig):
        self.cfg = cfg
        self.history: list[float] = []  # median accepted norm of each recent round

    def judge(self, norms: dict[str, float], label: str = "") -> Verdict:
        """Decides the factor of each contribution of one round from its norm, then remembers the round."""
        verdict = Verdict({island: 1.0 for island in norms})
        if not self.cfg.enabled:
            return verdict
        for island in sorted(norms):
            others = [n for i, n in norms.items() if i != island] + self.history
            if not others:
                continue
            reference = statistics.median(others)
            norm = norms[island]
            if reference > 0 and norm > self.cfg.norm_factor * reference:
                drop = self.cfg.action == "drop"
                verdict.factors[island] = 0.0 if drop else reference / norm
                (verdict.dropped if drop else verdict.clipped).append(island)
                log.warning("%s%s's pseudo-gradient norm %.4g is %.1fx the reference %.4g (factor %g): %s",
                            label, island, norm, norm / reference, reference, self.cfg.norm_factor,
                            "dropped from the round" if drop else "clipped to the reference norm")
        kept = [n * verdict.factors[i] for i, n in norms.items() if verdict.factors[i] > 0]
        if kept:
            verdict.reference = statistics.median(kept)
            self.history = (self.history + [verdict.reference])[-self.cfg.history:]
        return verdict

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state.get("history", []))
