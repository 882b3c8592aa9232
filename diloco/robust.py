"""Robust aggregation: a pseudo-gradient whose norm is an outlier is clipped (or dropped) before the mean, one that
points against the round's majority is dropped, and the run's first outer step waits for a quorum.

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

Clipping bounds an update's size, not its direction: one island in three
pushing -2.7x its honest update has 2.7x an honest norm (under the factor) and
turns the mean around. So the guard also compares directions. Each contribution
is sketched as it arrives (a CountSketch of SKETCH_DIM buckets, keyed by a secret
the coordinator draws at start, so nobody can shape a push to look agreeable in
the sketch alone); at the close the sketches' cosines estimate the contributions'
(to about 1/sqrt(SKETCH_DIM)). A contribution whose cosine with a strict majority
of the others is below `direction_cosine` (-0.1) is dropped. Honest islands
start from the same parameters and descend the same loss: their pseudo-gradients
agree (cosines 0.36-0.70 on the demo), and independent noise sits near 0, so an
honest round drops nothing and folds exactly what it folded before. What a
member can still do within the check is bounded: a push at most
-direction_cosine x norm_factor = 0.3x an honest norm against the others. It
needs a majority: with two contributions nobody can tell which is honest
(documented in docs/security.md), so rounds of fewer than three are judged on
norms alone.

With no reference at all (no earlier round, one contribution) a lone push
would be folded whole: whoever joins first could move the parameters as far as
it likes. So until the guard has a reference, a round closes only with at least
`first_quorum` contributions (default 2; a run of one island sets 1, as diloco-sim does for one).
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from diloco.config import RobustConfig
from diloco.wire.kernels import _count_sketch

log = logging.getLogger(__name__)


@dataclass
class Verdict:
    """What the guard decided for one round: a factor per contribution (1 kept, < 1 clipped, 0 dropped)."""

    factors: dict[str, float] = field(default_factory=dict)
    clipped: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    reference: float = math.nan


def add_exact(parts: list[float], x: float) -> None:
    """Adds x to parts, non-overlapping floats whose sum is exactly the sum of everything added (Shewchuk's partials,
    as math.fsum keeps them). math.fsum(parts) is that sum correctly rounded, whatever the order the values came in,
    so a contribution's sum of squares is the same whether one coordinator or K shards (each summing its own
    parameters' chunks, the leader joining their parts) received it."""
    i = 0
    for y in parts:
        if abs(x) < abs(y):
            x, y = y, x
        hi = x + y
        lo = y - (hi - x)
        if lo:
            parts[i] = lo
            i += 1
        x = hi
    parts[i:] = [x]


SKETCH_DIM = 1 << 14  # the kernel's buckets (diloco/wire/kernels.py _count_sketch): cosines to about +-0.01
SKETCH_BYTES = SKETCH_DIM * 8  # a sketch is float64


class Sketcher:
    """CountSketches of pseudo-gradients, keyed by a secret: every contribution of a fragment is sketched with the
    same keys, so their sketches' cosines estimate theirs."""

    def __init__(self, secret: bytes):
        self.secret = secret
        self._keys: dict[str, np.uint64] = {}

    @staticmethod
    def empty() -> np.ndarray:
        return np.zeros(SKETCH_DIM, dtype=np.float64)

    def add(self, sketch: np.ndarray, name: str, offset: int, values: np.ndarray) -> None:
        """Adds float32 values, elements offset.. of tensor `name`, into sketch."""
        key = self._keys.get(name)
        if key is None:  # two pushes' threads may both derive it: the same key, so the race is harmless
            digest = hashlib.blake2b(name.encode(), key=self.secret, digest_size=8).digest()
            key = self._keys[name] = np.uint64(int.from_bytes(digest, "little"))
        _count_sketch(values, offset, key, sketch)


def cosines(sketches: dict[str, np.ndarray]) -> dict[tuple[str, str], float]:
    """The estimated cosine of every two contributions (names in sorted order, each pair once); a zero sketch has
    none."""
    norms = {i: float(np.linalg.norm(s)) for i, s in sketches.items()}
    names = sorted(i for i in sketches if norms[i] > 0)
    return {(i, j): float(sketches[i] @ sketches[j]) / (norms[i] * norms[j]) for k, i in enumerate(names) for j in names[k + 1:]}


def opposed(sketches: dict[str, np.ndarray], cosine: float) -> dict[str, list[float]]:
    """The contributions whose cosine with a strict majority of the others is below `cosine`, each with its
    cosines to the others; none with fewer than three (no majority to side with)."""
    pairs = cosines(sketches)
    names = sorted({i for pair in pairs for i in pair})
    if len(names) < 3:
        return {}
    found = {}
    for i in names:
        others = [pairs[(i, j) if i < j else (j, i)] for j in names if j != i]
        if 2 * sum(c < cosine for c in others) > len(others):
            found[i] = others
    return found


class NormGuard:
    def __init__(self, cfg: RobustConfig):
        self.cfg = cfg
        self.history: list[float] = []  # median accepted norm of each recent round

    def quorum(self) -> int:
        """The contributions a round needs before it may close: first_quorum until the guard has a reference."""
        return self.cfg.first_quorum if self.cfg.enabled and not self.history else 1

    def judge(self, norms: dict[str, float], label: str = "", sketches: dict[str, np.ndarray] | None = None) -> Verdict:
        """Decides the factor of each contribution of one round from its norm and (sketches) its direction, then
        remembers the round."""
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
        if self.cfg.direction_check and sketches:
            self._judge_directions(verdict, sketches, label)
        kept = [n * verdict.factors[i] for i, n in norms.items() if verdict.factors[i] > 0]
        if kept:
            verdict.reference = statistics.median(kept)
            self.history = (self.history + [verdict.reference])[-self.cfg.history:]
        return verdict

    def _judge_directions(self, verdict: Verdict, sketches: dict[str, np.ndarray], label: str) -> None:
        judged = {i: s for i, s in sketches.items() if verdict.factors.get(i, 0.0) > 0}
        for island, cosines in opposed(judged, self.cfg.direction_cosine).items():
            verdict.factors[island] = 0.0
            if island in verdict.clipped:
                verdict.clipped.remove(island)
            verdict.dropped.append(island)
            log.warning("%s%s's pseudo-gradient points against the round's majority (cosines %s with the others, below "
                        "%g): dropped from the round", label, island, ", ".join(f"{c:.2f}" for c in cosines),
                        self.cfg.direction_cosine)

    def remember(self, reference: float) -> None:
        """A round judged elsewhere (the leading shard's guard, coordinator/judging.py) joins the history as if here."""
        if not math.isnan(reference):
            self.history = (self.history + [reference])[-self.cfg.history:]

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state.get("history", []))
