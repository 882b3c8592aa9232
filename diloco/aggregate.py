"""How a round's contributions become the mean the outer step takes: the guard's verdict, the fold, the step.

One algorithm, called by everyone: coordinator/rounds.py applies each round with these functions, and the
convergence benchmark (benchmarks/convergence_wire.py) with the same ones in the same order, so the figures it
reports are the coordinator's arithmetic, bit for bit (tests/test_aggregate.py). Nothing here knows where a
contribution's chunks are kept (the coordinator's spools, the benchmark's memory): a contribution is anything
that satisfies Contribution.

A round, in order:

1. judge: the norm guard (diloco/robust.py) on each contribution's norm per unit of inner learning rate and on
   its direction sketch; one trained on no tokens (zero weight) is not judged.
2. fold: the contributions in the order given (the coordinator's canonical island order, so the mean does not
   depend on arrival order), each decoded chunk by chunk into the accumulator (diloco/outer.py) with its weight
   (tokens, discounted when late) times the guard's factor; a dropped one is never read.
3. outer_step: the step on the mean (delayed Nesterov with the late part apart), taken only when the round
   folded some weight (takes_step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor, Future, wait
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.robust import NormGuard, Verdict
from diloco.wire.codec import Codec


class EncodedChunk(Protocol):
    """numel elements of parameter `name` from `offset`, as the codec encoded them (a pb.TensorChunk, a spooled one)."""

    @property
    def name(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def payload(self) -> bytes | memoryview: ...


class ChunkToFold(NamedTuple):
    """One chunk of a contribution as the fold reads it."""

    chunk: EncodedChunk
    codec: Codec  # the codec its push stream came in (compression per link: islands' codecs differ)
    stable: bool = False  # its payload stays valid while later chunks are read, so another thread may add it meanwhile


class Contribution(Protocol):
    """One island's pseudo-gradient for one round, whole, with what the guard judges it on (made as it arrived)."""

    tokens: int  # trained on; 0: a resynced island's zero pseudo-gradient, neither judged nor weighed
    lr_sum: float  # the inner learning rates it was trained with, summed: its norm is judged per unit of it
    sketch: np.ndarray | None  # its CountSketch (diloco/robust.py Sketcher)
    sketched: bool  # every part of it was sketched (a run below three members sketches nothing)
    staleness: int  # rounds between the one it was trained for and the one it is folded into (0: on time)
    origin: int  # the round it was trained for

    @property
    def sumsq(self) -> float: ...  # its values' sum of squares (fp64, summed exactly: add_exact)

    @property
    def weight(self) -> float | int: ...  # in the token-weighted mean: tokens, discounted when late

    def chunks(self, codec: Codec) -> Iterable[ChunkToFold]:
        """Its chunks, each covering its own elements once; codec: the round's, for parts that name none."""
        ...

    def release(self) -> None:
        """The fold is done with it (folded or dropped): what holds its chunks may go."""
        ...


Keyed = Sequence[tuple[str, Contribution]]  # (island id, contribution), in the order they fold
C = TypeVar("C", bound=Contribution)


def fold_key(island_id: str, contribution: Contribution) -> str:
    """Names a contribution in a round's verdict: an island may have an on-time and a late one in the same round."""
    return island_id if not contribution.staleness else f"{island_id} (late from round {contribution.origin})"


def judge(guard: NormGuard, contributions: Keyed, label: str = "") -> Verdict:
    """The guard's verdict on norms per unit of inner learning rate (comparable across warmup and a fragment's
    shorter first round) and on directions; contributions trained on no tokens are not judged (their factor is 1,
    their weight 0)."""
    judged = [(fold_key(island, c), c) for island, c in contributions if c.tokens]
    return guard.judge({key: math.sqrt(c.sumsq) / c.lr_sum for key, c in judged}, label,
                       {key: c.sketch for key, c in judged if c.sketched and c.sketch is not None})


def kept(contributions: Sequence[tuple[str, C]], verdict: Verdict) -> list[tuple[str, C]]:
    """The contributions the verdict did not drop (the clipped ones are kept, at their factor)."""
    return [(island, c) for island, c in contributions if fold_key(island, c) not in verdict.dropped]


def fold(accumulator: PseudoGradientAccumulator, codec: Codec, contributions: Keyed, verdict: Verdict, numel: int,
         split_late: bool = False, pool: Executor | None = None) -> int:
    """Folds the kept contributions in the given order, releasing each once done with; returns the elements folded.
    split_late: late contributions go to the accumulator's late part (delayed Nesterov, diloco/outer.py). pool:
    threads that decode and add a contribution's chunks at once (each element still gets the contributions in
    order)."""
    folded = 0
    for island, contribution in contributions:
        factor = verdict.factors.get(fold_key(island, contribution), 1.0)
        if factor != 0.0:  # a dropped contribution is never read
            fold_one(accumulator, codec, contribution, factor, numel, split_late and contribution.staleness > 0, pool)
            folded += numel
        contribution.release()
    if not accumulator.contributions:  # every contribution dropped: the round's mean is zero
        accumulator.commit(0)
    return folded


def fold_one(accumulator: PseudoGradientAccumulator, codec: Codec, contribution: Contribution, factor: float, numel: int,
             late: bool = False, pool: Executor | None = None) -> None:
    """Adds one contribution, every chunk at its weight's scale times factor, and counts it (commit)."""
    # Token-weighted; a late contribution's weight carries its staleness discount.
    scale = accumulator.scale_for(contribution.weight) * factor
    accumulator.part(late)  # allocated here, not by one of the threads
    elements = 0
    pending: list[Future[None]] = []

    def add(chunk: EncodedChunk, decoder: Codec) -> None:
        accumulator.add_encoded(chunk.name, chunk.offset, chunk.numel, chunk.payload, decoder, scale, late)

    try:
        for chunk, decoder, stable in contribution.chunks(codec):
            if pool is not None and stable:  # the codecs' kernels and torch's add release the GIL
                pending.append(pool.submit(add, chunk, decoder))
            else:  # e.g. read from disk into a buffer the next chunk reuses: added before the next is read
                add(chunk, decoder)
            elements += chunk.numel
    finally:
        wait(pending)  # every chunk of this contribution is in before the next contribution's
    for done in pending:
        done.result()
    # The caller proved exactly-once coverage already; this is the invariant a round's summary reports.
    assert elements == numel, (elements, numel)
    accumulator.commit(contribution.weight, late)


def takes_step(kept_contributions: Keyed) -> bool:
    """Whether a round steps: one that folds no weight (every contribution trained on 0 tokens, or dropped) does
    not, as a step on momentum alone would move the parameters with no data behind it."""
    return any(c.weight for _, c in kept_contributions)


def outer_step(outer: OuterOptimizer, accumulator: PseudoGradientAccumulator, delayed: bool = False) -> None:
    """The outer step on the folded round's mean: delayed Nesterov with the late part apart, else SGD consuming the
    accumulator's sums (Nesterov's look-ahead is formed in them: reset the accumulator before the next round)."""
    mean, late = accumulator.parts()
    if delayed:
        outer.step_delayed(mean, late)
    else:
        outer.step(mean, consume=True)

