"""One fragment's round, read top to bottom: pushes taken in, the close, the fold, the outer step, the publication.

The coordinator's round machine. Its collaborators are named and live apart:
the spool (coordinator/spool.py: chunks on disk until the close), the
publication (coordinator/publish.py: what pulls send, an immutable version a
round), membership (coordinator/membership.py: who is waited for), and the
state that holds the fragments (coordinator/state.py: joins, leaves, eval).
In this file, in the order a round goes:

1. Records the round machine shares (Phase, Contribution, Closing, Closed) and
   the pure rules: what a push may claim (check_claim), the inner learning
   rates it was trained with (lr_sum: the coordinator's own schedule), when a
   round may close (close_reason), what its summary says (round_summary);
   what the process around the fragments hooks into each close (Hooks: evaluation,
   summaries, memory, eager mean, ledger, membership, run log, checkpoint; registered
   at start, coordinator/hooks.py and server.py); and the parameters' readers-writer
   lock (many pulls at once, or one outer step).
2. The outer step, one object a fragment chooses at construction (WholeStep,
   DelayedStep, StreamedStep; no_step for a round that folds no weight), and late
   rounds, one object (LateRounds; None when rounds.late_rounds = 0). Then
   FragmentRounds, one fragment's round sequence: intake (begin_push, receive:
   the header's checks, chunks verified and spooled as they arrive, sketched
   for the norm guard, contributions made whole), reading (wait_for_result,
   reading: taken under the parameters' read lock, sent without it), closing
   (close_reason, close, fold_ahead, step, apply: judge, fold, outer step,
   open the next round, the after-close hooks), and its checkpoint (state_dict).
   The judge, the fold and the outer step are diloco/aggregate.py's, which the
   convergence benchmark calls too.
3. Folding ahead: FoldAhead.
4. RoundDriver: one thread per fragment that steps its rounds (FragmentRounds.step).

Without streaming the whole model is one fragment: plain DiLoCo's round state
machine. With Streaming DiLoCo each fragment has its own accumulator, outer
optimizer, publication, round counter, deadline and driver thread, so a slow
fragment never holds another back. What fragments share reaches them through
FragmentContext, a narrow seam (the condition variable, the clock, membership);
a fragment never sees the coordinator's state.

OPEN: pushes are spooled until an island's contribution is whole; between its
close checks the driver folds the complete ones that come first in canonical
order (fold_ahead, FoldAhead below). close(): CLOSING once every live island
(not on probation) contributed or was dropped, max_islands did, or the
deadline passed with min_islands. apply(): folds the contributions in
canonical island order (the aggregate does not depend on arrival order), takes
the outer step, publishes, opens the next round; FINISHED after the last.
The close keeps what was folded ahead only when its contributions start with
exactly those, so the result is the same whenever folding happened.

Late contributions (rounds.late_rounds = k > 0, LateRounds): a push up to k rounds after its
round closed (or a contribution still incomplete at the close) is kept in
`late.held` and folded at the next close after the on-time ones, in canonical
island order, with its weight discounted by rounds.late_discount per round of
staleness (Contribution.weight); later than k it is refused (ROUND_CLOSED). One coordinator folds them all, so copies stay identical.
A round does not wait for an island whose last contribution came late (`behind`)
until it contributes on time again.

Folding, through the norm guard (diloco/robust.py): each contribution's norm is summed chunk by chunk as its pushes arrive
(Codec.sumsq, with the finiteness check), so at the close the guard judges
the whole round before anything is folded, and every contribution is decoded once: folded in canonical island
order with its token weight (discounted when late) times the guard's factor (1
kept, < 1 clipped); a dropped one is not folded at all (diloco/aggregate.py). With split_late
(rounds.late_mode = "delayed_nesterov") the late ones go to the accumulator's late
part, over the same total weight (diloco/outer.py: delayed Nesterov).

Folding ahead (FoldAhead): while a round is still open, the round driver folds
each complete contribution that comes next in canonical order among the islands
that may still contribute on time, so a round whose islands finish pushing at
different times closes with one fold on its critical path instead of one per
island. These are exactly the operations aggregate.fold would do at the close, in the
same order, so the close keeps them when its contributions start with the same
ones, on time and kept whole by the guard; otherwise it resets the accumulator
and folds everything from the spools, which stay until the close.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from coordinator.ledger import DataLedger, ranges_of
from coordinator.links import LinkAdvisor
from coordinator.membership import Membership, canonical_order
from coordinator.publish import DeltaStream, Publication, Reading, step_and_publish
from coordinator.spool import Spool, SpoolCorrupt, Spools
from coordinator.stragglers import PushPace
from diloco import aggregate
from diloco.aggregate import ChunkToFold, fold_key
from diloco.wire.codec import Codec
from diloco.config import RunConfig
from diloco.inner import inner_lr
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.pace import lr_position, max_round_steps, round_first_position
from diloco.params import ranges_checksum
from diloco.wire.refusal import Reason, Refused
from diloco.robust import NormGuard, Sketcher, Verdict, add_exact
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import (ChunkCorrupt, ChunkError, Coverage, FlatRange, Manifest, downlink_codec, framed_size,
                         verify_and_decode, verify_chunk)

log = logging.getLogger(__name__)


# === 1. Records and rules ====================================================================================

class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    FINISHED = "finished"


@dataclass
class Contribution:
    """One island's pseudo-gradient for one round, possibly pushed over several streams."""

    tokens: int
    train_loss: float
    coverage: Coverage
    spools: list[Spool] = field(default_factory=list)
    state: str = "pending"  # pending -> folding -> committed
    samples: list[tuple[int, int]] = field(default_factory=list)  # token corpus: the positions trained on
    sumsq_parts: list[float] = field(default_factory=list)  # of its values, summed exactly as chunks arrive (add_exact)
    sketch: np.ndarray | None = None  # its CountSketch, made as chunks arrive: the guard's direction check
    sketched: bool = True  # every stream of it came with a sketch (a run below three members sketches nothing)
    lr_sum: float = 1.0  # the inner learning rates it was trained with, summed: its norm is judged per unit of it
    origin: int = 0  # the round it was trained for
    codecs: list[Codec] = field(default_factory=list)  # each spool's codec (compression per link: islands' codecs differ)
    # Late contributions (rounds.late_rounds): rounds between origin and the round it is folded into, and
    # the factor on its token weight (rounds.late_discount ** staleness), set when that round closes.
    staleness: int = 0
    discount: float = 1.0

    @property
    def sumsq(self) -> float:
        """Its values' sum of squares, what the norm guard judges at the close."""
        return math.fsum(self.sumsq_parts)

    @property
    def weight(self) -> float | int:
        """Its weight in the token-weighted mean: its tokens, discounted when late (an int when on time, so plain
        rounds keep exactly the arithmetic they had)."""
        return self.tokens if not self.staleness else self.tokens * self.discount

    def chunks(self, codec: Codec) -> Iterator[ChunkToFold]:
        """Its chunks as the fold reads them (diloco/aggregate.py): each push stream's in the codec it came in, else
        codec; verified on arrival, and the spool checks its own digests."""
        for k, spool in enumerate(self.spools):
            decoder = self.codecs[k] if k < len(self.codecs) else codec
            for chunk in spool.read():
                yield ChunkToFold(chunk, decoder, chunk.stable)

    def release(self) -> None:
        """Folded or dropped: its spools go."""
        for spool in self.spools:
            spool.discard()


@dataclass
class Closing:
    """A round that stopped taking pushes: why, and the contributions to fold, in canonical order."""

    reason: str
    contributions: list[tuple[str, Contribution]]
    waited_s: float = 0.0  # from the round's opening to its close


@dataclass(frozen=True)
class LeaderClose:
    """On a following shard of several: the leading shard's word that it closed a round of this fragment, with the
    on-time contributions of these islands (CloseRound, coordinator/judging.py), and when it came."""

    round: int
    islands: frozenset[str]
    at: float


@dataclass
class Closed:
    """A closed round, as the after-close hooks and the driver see it."""

    summary: pb.RoundSummary
    total_rounds: int = 0  # rounds closed so far over every fragment (the checkpoint step), counted at the round change
    run_finished: bool = False
    closing: Closing | None = None  # what the round closed with
    kept: list[tuple[str, Contribution]] = field(default_factory=list)  # the contributions the guard did not drop
    skipped: bool = False  # no weight folded: no outer step


@dataclass
class Hooks:
    """What the process around the fragments does at each point of a round, registered at start, each list called in
    order with the fragment: coordinator/state.py registers evaluation, summaries, memory sampling, the eager mean, ledger
    settlement and membership (coordinator/hooks.py), coordinator/server.py the run log, checkpoint and health."""

    idle: list[Callable[..., None]] = field(default_factory=list)  # (fragment): between close checks of an open round
    closing: list[Callable[..., None]] = field(default_factory=list)  # (fragment, Closing): before the fold
    stepping: list[Callable[..., None]] = field(default_factory=list)  # (fragment, Closed): before the outer step, under
    # the write lock (their time is counted with the publication, as what they make is sent with it)
    settling: list[Callable[..., None]] = field(default_factory=list)  # (fragment, Closed): the round change, holding cond
    closed: list[Callable[..., None]] = field(default_factory=list)  # (fragment, Closed): after the round change

    @staticmethod
    def run(hooks: list[Callable[..., None]], *args) -> float:
        """Calls each hook with args; returns the seconds they took."""
        started = time.perf_counter()
        for hook in hooks:
            hook(*args)
        return time.perf_counter() - started


def lr_sum(header: pb.PushHeader, cfg: RunConfig) -> float:
    """The inner learning rates of the steps a push claims, summed (1.0 when that is not positive): a
    pseudo-gradient's norm grows with them (warmup, a fragment's shorter first round), so the norm guard
    compares norm / lr_sum. Where the steps sit on the schedule is the coordinator's to know (the push's
    fragment and round), not the island's word: a first_step claimed at the lr's peak would let an update
    through unclipped at many times an honest norm."""
    total = cfg.rounds.rounds * cfg.inner.steps_per_round
    first = min(max(round_first_position(header.fragment, header.round, cfg), 0), total)
    # The positions the island trained at (diloco/pace.py): a round's extra steps sit at its last position.
    steps = (lr_position(first, j, cfg) for j in range(min(max(1, header.inner_steps), total)))
    s = sum(inner_lr(t, total, cfg.inner) for t in steps)
    return s if s > 0 else 1.0


def check_claim(header: pb.PushHeader, cfg: RunConfig, ranks: int) -> None:
    """Refuses a push claiming more tokens or inner steps than the island's ranks can train in a round."""
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    steps = max_round_steps(cfg)  # time-boxed rounds and islands with their own H: up to inner.max_steps
    if header.inner_steps > steps or header.tokens > header.inner_steps * per_step * ranks or header.tokens % per_step:
        raise Refused(Reason.BAD_REQUEST, f"{header.tokens} tokens in {header.inner_steps} inner steps: not what {ranks} "
                      f"rank(s) train with batch {cfg.inner.batch_size} x seq_len {cfg.data.seq_len} in at most {steps} steps")


def close_reason(done: list[str], live: list[str], dropped: set[str], overdue: bool, min_islands: int,
                 max_islands: int) -> str | None:
    """Why a round may close, from who contributed (done), who is live and dropped, and the deadline; or None."""
    if not done:
        return None
    if len(done) >= max_islands:
        return "max_islands reached"
    if len(done) >= min_islands and all(i in done or i in dropped for i in live):
        return "every live island contributed"
    if overdue and len(done) >= min_islands:
        return "deadline"
    return None


def round_summary(round_: int, fragment: int, contributions: list, numel: int, cfg: RunConfig) -> pb.RoundSummary:
    """What a closing round is made of: its islands (contributions: (island_id, Contribution)), tokens, loss."""
    tokens = sum(c.tokens for _, c in contributions)
    n = len(contributions)
    return pb.RoundSummary(
        round=round_,
        islands=sorted({i for i, _ in contributions}),
        tokens=tokens,
        train_loss=sum(c.train_loss * c.tokens for _, c in contributions) / tokens if tokens else math.nan,
        eval_loss=math.nan,
        # A ring all-reduce of fp32 gradients every inner step over the same islands (this fragment's share).
        ddp_bytes=2.0 * max(n - 1, 0) * 4 * numel * cfg.inner.steps_per_round,
        fragment=fragment,
        fragments=cfg.streaming.fragments,
        contributions=[pb.IslandContribution(island_id=i, tokens=c.tokens, train_loss=c.train_loss, staleness=c.staleness,
                                             weight=float(c.weight), codec=c.codecs[0].name if c.codecs else "")
                       for i, c in contributions],
    )


def traffic_into(summary: pb.RoundSummary, traffic: dict[tuple[int, str], list[int]], round_: int) -> dict:
    """Moves round_'s per-island byte counts ((round, island) -> [up, down]) into its summary; returns the rest."""
    for (r, island_id), (up, down) in sorted(traffic.items()):
        if r == round_:
            summary.traffic.add(island_id=island_id, bytes_up=up, bytes_down=down)
            summary.bytes_up += up
            summary.bytes_down += down
    return {k: v for k, v in traffic.items() if k[0] > round_}


class ReadWriteLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    def acquire_write(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._writer = True
            self._cond.wait_for(lambda: self._readers == 0)

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()


# === 2. One fragment's round machine ========================================================================


@dataclass
class FragmentContext:
    """What a fragment's round machine shares with the rest of the coordinator."""

    cfg: RunConfig
    codec: Codec
    cond: threading.Condition
    clock: Callable[[], float]
    spools: Spools
    members: Membership
    run_finished: Callable[[], bool] = lambda: False  # every fragment finished (read holding cond)
    rounds_closed: Callable[[], int] = lambda: 0  # rounds closed over every fragment (read holding cond)
    hooks: Hooks = field(default_factory=Hooks)  # what the process does around each close (Hooks)
    fragment_of: Callable[[str], int | None] = lambda name: None  # for messages about another fragment's parameter
    ledger: DataLedger | None = None  # token corpus: who trains on which samples
    codecs: dict[str, Codec] | None = None  # what islands may push with, by name (wire.link_codecs; None: the run's codec)
    links: LinkAdvisor | None = None  # compression per link: throughput measured, codecs advised (coordinator/links.py)
    pool: Executor | None = None  # threads a close's folds and lossy publications run on (None: the driver's)
    # A coordinator of several shards (coordinator/judging.py): the round's verdict from every shard's part, and the
    # sketches' keys the shards share. None: this process judges alone, with keys only it knows.
    judge: Callable[[FragmentRounds, Closing], Verdict] | None = None
    sketch_secret: bytes | None = None
    # A following shard: its rounds close when the leading shard closed them (LeaderClose), with the same islands, or
    # at the deadline when the leader cannot be reached; never on this shard's own view of who pushed.
    follows_leader: bool = False


class Scratch:
    """One fp32 buffer a push's chunks are decoded into one after another (the direction sketch reads them as they
    arrive). A decoded chunk is megabytes, and a fresh tensor for each left allocator slack that grew with the
    pushes read at once (docs/benchmarks.md, the coordinator's memory)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def take(self, numel: int) -> torch.Tensor:
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel)
        return self._buffer[:numel]


class WholeStep:
    """Plain DiLoCo's outer step: the Nesterov step on the whole mean, then the publication."""

    split_late = False  # the late contributions folded into the mean with the others

    def __call__(self, f: FragmentRounds, closed: Closed, before_s: float) -> DeltaStream | None:
        started = time.perf_counter()
        aggregate.outer_step(f.outer, f.accumulator, self.split_late)
        closed.summary.step_s, started = time.perf_counter() - started, time.perf_counter()
        f.publication.publish()
        closed.summary.publish_s = time.perf_counter() - started + before_s
        return None


class DelayedStep(WholeStep):
    """rounds.late_mode = "delayed_nesterov": the late contributions in the accumulator's late part, stepped apart
    (diloco/outer.py: delayed Nesterov)."""

    split_late = True


class StreamedStep:
    """A lossy downlink with Nesterov: each chunk's span divided into the mean, stepped and published in one go, on
    every core, while pulls send the chunks made so far (coordinator/publish.py step_and_publish)."""

    split_late = False

    def __call__(self, f: FragmentRounds, closed: Closed, before_s: float) -> DeltaStream | None:
        summary = closed.summary
        stream = DeltaStream(f.round + 1, f.checksum, len({i for i, _ in closed.closing.contributions}), summary.tokens)
        with f.cond:
            f.streaming = stream
            f.cond.notify_all()
        try:
            summary.step_s, summary.publish_s = step_and_publish(f.publication, f.accumulator, f.outer, stream)
        except BaseException:
            stream.fail()
            with f.cond:
                f.streaming = None
            raise
        summary.publish_s += before_s
        return stream


def no_step(f: FragmentRounds, closed: Closed, before_s: float) -> None:
    """A round that folds no weight (every contribution trained on 0 tokens, or dropped) takes no outer step: a step
    on momentum alone would move the parameters with no data behind it. The parameters, momentum and checksum stay;
    the round moves on."""
    log.warning("%sround %d folds no tokens (%d contribution(s), none with weight): no outer step", f.label, f.round,
                len(closed.closing.contributions))
    f.publication.unchanged()


def outer_step_for(cfg: RunConfig, outer: OuterOptimizer, publication: Publication) -> WholeStep | StreamedStep:
    """The fragment's outer step, chosen once (at construction and at a restore, which may bring delayed Nesterov's
    carried momentum)."""
    if cfg.rounds.late_mode == "delayed_nesterov":
        return DelayedStep()
    if not publication.lossless and outer.steps_by_parameter:
        return StreamedStep()
    return WholeStep()


class LateRounds:
    """Late contributions (rounds.late_rounds = k > 0, the module docstring): those held for a later close, the
    islands a round does not wait for, and the checksum each recent round started from."""

    def __init__(self, cfg: RunConfig, round_: int, checksum: str, label: str) -> None:
        self.k, self.discount, self.label = cfg.rounds.late_rounds, cfg.rounds.late_discount, label
        self.held: dict[tuple[str, int], Contribution] = {}  # by (island, round trained for)
        # Islands whose last contribution came late: a round does not wait for them (they are folded late again if
        # they miss it), so the islands that keep pace never idle for one that does not.
        self.behind: set[str] = set()
        self.published: dict[int, str] = {round_: checksum}  # what a late push must have trained from

    def takes(self, round_: int, late: int) -> bool:
        """Whether a push for round_, late rounds late, is folded late (else refused)."""
        return 0 < late <= self.k and round_ in self.published

    def waived(self, on_time: Iterable[str]) -> set[str]:
        """The islands a round does not wait for: behind, or with a late contribution held, and not pushing on time now."""
        return (self.behind | {i for i, _ in self.held}) - set(on_time)

    def hold(self, round_: int, incomplete: dict[str, Contribution]) -> None:
        """At round_'s close: its incomplete contributions (their other streams may still come) fold into a later round."""
        for island_id, contribution in incomplete.items():
            self.held[(island_id, round_)] = contribution

    def due(self, round_: int, on_time: Iterable[str],
            order: Callable[[Iterable[str]], list[str]]) -> list[tuple[str, Contribution]]:
        """At round_'s close: drops the incomplete ones past k rounds; returns the complete ones, in canonical island
        order then by the round they trained for, each with its staleness and discount. Caller holds cond."""
        for key in [key for key, c in self.held.items() if c.state == "pending" and round_ + 1 - c.origin > self.k]:
            log.warning("%sround %d: %s's late contribution to round %d was incomplete; dropped", self.label, round_, *key)
            self.held.pop(key).release()
        rank = {i: n for n, i in enumerate(order({i for i, _ in self.held}))}
        due = []
        for key in sorted((key for key, c in self.held.items() if c.state == "complete"), key=lambda key: (rank[key[0]], key[1])):
            late = self.held.pop(key)
            late.staleness = round_ - late.origin
            late.discount = self.discount ** late.staleness
            due.append((key[0], late))
        self.behind = (self.behind | {i for i, _ in due} | {i for i, _ in self.held}) - set(on_time)
        return due

    def drop_pending(self, island_id: str) -> None:
        """An island left: its half-pushed late contributions go. Caller holds cond."""
        for key in [k for k, c in self.held.items() if k[0] == island_id and c.state == "pending"]:
            self.held.pop(key).release()

    def opened(self, round_: int, checksum: str) -> None:
        """round_ opened from checksum: the rounds a late push may still be for are those k back."""
        self.published = {r: c for r, c in self.published.items() if r >= round_ - self.k}
        self.published[round_] = checksum

    def restore(self, round_: int, checksum: str) -> None:
        """What earlier rounds started from is not in a checkpoint: a push for them is refused (ROUND_CLOSED)."""
        self.published = {round_: checksum}


class FragmentRounds:
    """One fragment's round sequence (the module docstring): intake, reading, and each round's close: judge, fold,
    outer step (one object chosen at construction), open the next round, the after-close hooks."""

    def __init__(self, ctx: FragmentContext, index: int, params: dict[str, torch.Tensor]):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.index = ctx, cfg, index
        self.codec, self.cond, self.clock, self.members = ctx.codec, ctx.cond, ctx.clock, ctx.members
        # Messages name the fragment only when there is more than one.
        self.label = f"fragment {index} " if cfg.streaming.fragments > 1 else ""
        self.manifest = Manifest.of(params)
        self.outer = OuterOptimizer(params, cfg.outer)
        self.publication = Publication(params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes, ctx.pool, ctx.spools.directory)
        self.accumulator = PseudoGradientAccumulator(self.manifest.shapes)
        self.ahead = FoldAhead(self.members.order)  # what of the open round is folded already (the driver's thread only)
        self.guard = NormGuard(cfg.robust)
        self.sketcher = Sketcher(ctx.sketch_secret or os.urandom(16))  # keys only this coordinator knows (diloco/robust.py)
        self.param_lock = ReadWriteLock()
        self.phase, self.round, self.round_opened_at = Phase.OPEN, 0, self.clock()
        self.contributions: dict[str, Contribution] = {}
        self.hooks = ctx.hooks
        self.outer_step = outer_step_for(cfg, self.outer, self.publication)
        self.judge = ctx.judge or (lambda f, closing: aggregate.judge(f.guard, closing.contributions, f.label))
        # Late contributions (rounds.late_rounds); None without them.
        self.late = LateRounds(cfg, self.round, self.checksum, self.label) if cfg.rounds.late_rounds else None
        self.dropped: set[str] = set()
        self.traffic: dict[tuple[int, str], list[int]] = {}  # (round, island) -> [up, down]
        # The last closed round: islands and tokens in it, and (eager updates) its mean pseudo-gradient.
        self.last_islands = self.last_tokens = 0
        self.last_round_s = 0.0  # open to close (compression per link sizes pushes to it)
        self.mean_chunks: list[pb.TensorChunk] = []
        self.streaming: DeltaStream | None = None  # the next round's lossy update while it is made (apply)
        # Set by a restore: where the fragment restarted, and the latest round islands had reached.
        self.restored_round: int | None = None
        self.restored_at = self._last_wait_log = 0.0
        self.max_round_seen = 0
        self.leader_close: LeaderClose | None = None  # a following shard: the leader's latest close of this fragment
        self.absent: set[str] = set()  # a following shard: islands the leader closed with that never pushed here
        self.pace = PushPace(cfg.limits.push_pace_factor, cfg.limits.push_idle_s)  # pushes still arriving: waited for?
        self._slow_logged: set[tuple[str, int]] = set()

    @property
    def checksum(self) -> str:
        return self.publication.checksum

    def state_proto(self) -> pb.FragmentState:
        return pb.FragmentState(index=self.index, round=self.round, checksum=self.checksum)

    # --- intake: a push's header checked, its chunks spooled, its contribution made whole ---------

    def begin_push(self, header: pb.PushHeader) -> None:
        """Checks a push's header before any chunk is read."""
        island = self.members.touch(header.island_id)
        if self.cfg.robust.enabled and self.cfg.robust.check_claims:
            check_claim(header, self.cfg, island.ranks)
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, header.round)
            if self.phase is Phase.FINISHED:
                raise Refused(Reason.RUN_FINISHED, f"the run has finished{' for ' + self.label.strip() if self.label else ''}")
            late = self.lateness(header.round, "is closed")
            self.absent.discard(header.island_id)
            if header.island_id in self.dropped:
                raise Refused(Reason.DROPPED, f"{header.island_id} was dropped from {self.label}round {self.round}")
            if header.codec not in self.push_codecs:
                raise Refused(Reason.CODEC_MISMATCH, f"codec {header.codec!r} is not one the run takes ({', '.join(self.push_codecs)})")
            if header.tokens < 0:
                raise Refused(Reason.BAD_REQUEST, f"tokens must be >= 0, got {header.tokens}")
            if not math.isfinite(header.train_loss):  # it would make the round's reported loss NaN
                raise Refused(Reason.NOT_FINITE, f"train_loss {header.train_loss} is not finite: resync and go on")
            # A late push was trained from the parameters its own round started from.
            trained_from = self.late.published.get(header.round, "") if late else self.checksum
            if not header.global_checksum:  # it would skip the check below: trained from parameters nobody can name
                raise Refused(Reason.BAD_REQUEST, "the push names no global_checksum (of the global parameters it was trained "
                              "from): fetch the global parameters and push with their checksum")
            if header.global_checksum != trained_from:
                self.members.events.checksum_resyncs += 1
                log.warning(
                    "%s trained %sround %d from global parameters with checksum %s, not the coordinator's %s; "
                    "it must resync", header.island_id, self.label, header.round, header.global_checksum[:12], trained_from[:12],
                )
                raise Refused(
                    Reason.CHECKSUM_MISMATCH,
                    "your global parameters differ from the coordinator's (checksum mismatch); fetch them again",
                )
            existing = self.late.held.get((header.island_id, header.round)) if late else self.contributions.get(header.island_id)
            if existing is not None and existing.state != "pending":
                raise Refused(Reason.DUPLICATE, f"{header.island_id} already contributed to {self.label}round {header.round}")
            if existing is not None and existing.tokens != header.tokens:
                raise Refused(Reason.BAD_REQUEST, f"tokens {header.tokens} differ from {existing.tokens} sent earlier for this round")
        if self.ctx.ledger is not None:
            self.ctx.ledger.check(header.island_id, self.index, ranges_of(header.samples), header.tokens)

    @property
    def push_codecs(self) -> dict:
        """The codecs pushes may come in, by name: the run's, and with compression per link wire.link_codecs."""
        return self.ctx.codecs or {self.codec.name: self.codec}

    def _verify(self, chunk: pb.TensorChunk, payload: bytes, codec, sketch: np.ndarray | None, scratch: Scratch) -> float:
        """ChunkError when malformed; else the values' sum of squares (the norm guard's, when it is on; else 0),
        not finite when a value is not. With a sketch, the values are decoded once, into scratch, and added to it."""
        if chunk.name not in self.manifest.shapes and (owner := self.ctx.fragment_of(chunk.name)) is not None:
            raise ChunkError(f"{chunk.name} belongs to fragment {owner}, not to fragment {self.index}")
        if sketch is None:
            return verify_chunk(chunk, self.manifest, codec, payload, sumsq=self.cfg.robust.enabled)
        sumsq, values = verify_and_decode(chunk, self.manifest, codec, payload, scratch.take(chunk.numel))
        if math.isfinite(sumsq):  # the guard's direction check (diloco/robust.py), off the close's path
            self.sketcher.add(sketch, chunk.name, chunk.offset, values.numpy())
        return sumsq

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        """Spools one push stream; the contribution is complete once every element arrived exactly once.

        A broken stream or a bad chunk discards this stream's spool, so the
        aggregate never sees part of a contribution. A corrupt chunk keeps the
        chunks before it and tells the island how many to skip when it resends.
        """
        self.begin_push(header)
        codec, started, received = self.push_codecs[header.codec], time.monotonic(), 0
        # The island's spools hold at most its share: the spool split over the members (coordinator/spool.py).
        spool: Spool | None = self.ctx.spools.open(self.manifest.total_numel(), header.island_id, len(self.members.islands))
        ranges: list[tuple[str, int, int, float]] = []  # each chunk's address and sum of squares (the norm guard)
        # The guard's direction check needs three contributions (a majority): a run of fewer members pays nothing for it.
        robust = self.cfg.robust
        sketch = self.sketcher.empty() if robust.enabled and robust.direction_check and len(self.members.islands) >= 3 else None
        scratch = Scratch()
        try:
            for chunk in chunks:
                payload = chunk.payload
                try:
                    sumsq = self._verify(chunk, payload, codec, sketch, scratch)
                except ChunkCorrupt as e:
                    self._attach(header, spool, ranges, codec, sketch)
                    spool = None  # the contribution owns the chunks kept so far
                    raise Refused(Reason.CORRUPT_CHUNK, f"{e}; resend from chunk {len(ranges)}", resend_from_chunk=len(ranges)) from e
                except ChunkError as e:
                    raise Refused(Reason.BAD_CHUNK, str(e)) from e
                if not math.isfinite(sumsq):
                    self._drop_nonfinite(header, chunk)
                spool.write(chunk.name, chunk.offset, chunk.numel, chunk.xxh3, payload)
                ranges.append((chunk.name, chunk.offset, chunk.numel, sumsq))
                size = framed_size(chunk, len(payload))
                received += size
                self._count(header.round, header.island_id, up=size, elements=chunk.numel)
            if self.ctx.links is not None:  # what this island's link delivers (compression per link)
                self.ctx.links.observe(header.island_id, received, time.monotonic() - started)
            return self._attach(header, spool, ranges, codec, sketch)
        except BaseException:
            if spool is not None:
                spool.discard()
            raise

    def _drop_nonfinite(self, header: pb.PushHeader, chunk: pb.TensorChunk) -> None:
        with self.cond:
            if self.phase is Phase.OPEN and header.island_id in self.contributions:
                self.drop(header.island_id)
            self.dropped.add(header.island_id)
            self.members.events.dropped_nonfinite += 1
            self.cond.notify_all()
        log.error(
            "%s pushed a pseudo-gradient with NaN/Inf in %s (elements %d..%d); dropped from %sround %d",
            header.island_id, chunk.name, chunk.offset, chunk.offset + chunk.numel, self.label, header.round,
        )
        raise Refused(Reason.NOT_FINITE, f"pseudo-gradient is not finite in {chunk.name}; dropped from {self.label}round {header.round}: "
                      "resync and go on")

    def _attach(self, header: pb.PushHeader, spool: Spool, ranges: list[tuple[str, int, int, float]], codec,
                sketch: np.ndarray | None) -> pb.PushResponse:
        spool.close()
        with self.cond:
            if self.phase is Phase.CLOSING and self.late is not None:
                # The round is being folded (a short while): this push joins the next round, late.
                self.cond.wait_for(lambda: self.phase is not Phase.CLOSING, 600)
            late = self.lateness(header.round, "closed while the push was in flight")
            if not self.members.is_member(header.island_id) or header.island_id in self.dropped:
                raise Refused(Reason.DROPPED, f"{header.island_id} left {self.label}round {header.round} while pushing")
            bucket, key = (self.late.held, (header.island_id, header.round)) if late else (self.contributions, header.island_id)
            contribution = bucket.get(key)
            if contribution is None:
                contribution = Contribution(header.tokens, header.train_loss, Coverage(self.manifest), samples=ranges_of(header.samples),
                                            lr_sum=lr_sum(header, self.cfg), origin=header.round)
                bucket[key] = contribution
            trial = contribution.coverage.copy()
            for name, offset, numel, _ in ranges:
                trial.add(name, offset, numel)
            if trial.overlaps():
                raise Refused(Reason.DUPLICATE, f"push overlaps data already received: {trial.problem()}")
            contribution.coverage = trial
            contribution.spools.append(spool)
            contribution.codecs.append(codec)
            for r in ranges:
                add_exact(contribution.sumsq_parts, r[3])
            if sketch is None:
                contribution.sketched = False
            else:
                contribution.sketch = sketch if contribution.sketch is None else contribution.sketch + sketch
            elements = sum(r[2] for r in ranges)
            response = pb.PushResponse(accepted=True, elements=elements, late=bool(late), folded_into=self.round)
            if trial.problem():  # more streams of this island's contribution are still to come
                return response
            contribution.state, response.contribution_complete = "complete", True
            self.pace.whole(header.island_id, header.round, self.clock())
            self.members.pushed(header.island_id)
            log.info("%sround %d: %s contributed %d tokens%s", self.label, header.round, header.island_id, header.tokens,
                     f", {late} round(s) late: folded into round {self.round}" if late else "")
            self.cond.notify_all()
        return response

    def lateness(self, round_: int, what: str) -> int:
        """0 for a push to the open round; s > 0 for one s rounds late that the current round takes (rounds.late_rounds,
        and the coordinator knows what that round started from); else refuses ROUND_CLOSED. Caller holds cond."""
        if round_ == self.round and self.phase is Phase.OPEN:
            return 0
        if round_ > self.round:  # only after a restart from a checkpoint: the island must go back to our round
            raise Refused(Reason.ROUND_AHEAD, f"{self.label}round {round_} is ahead of the coordinator's round {self.round} "
                          "(it restarted from a checkpoint); resync", current_round=self.round)
        late = self.round - round_ + (self.phase is Phase.CLOSING)  # while a round is folded, pushes join the next one
        if self.late is not None and self.phase is not Phase.FINISHED and self.late.takes(round_, late):
            return late
        self.members.events.late_pushes += 1
        beyond = f" and more than rounds.late_rounds={self.cfg.rounds.late_rounds} rounds ago" if self.cfg.rounds.late_rounds else ""
        raise Refused(Reason.ROUND_CLOSED, f"{self.label}round {round_} {what}{beyond} (current round {self.round}); "
                      "fetch the global parameters and train for the current round", current_round=self.round)

    def drop(self, island_id: str) -> None:
        """Forgets an island's contribution to this round. Caller holds cond."""
        self.contributions.pop(island_id).release()

    def drop_pending(self, island_id: str) -> None:
        """An island left: its half-pushed contributions go (late ones too). Caller holds cond."""
        contribution = self.contributions.get(island_id)
        if contribution is not None and contribution.state == "pending" and self.phase is Phase.OPEN:
            self.drop(island_id)
        if self.late is not None:
            self.late.drop_pending(island_id)

    def _count(self, round_: int, island_id: str, up: int = 0, down: int = 0, elements: int = 0) -> None:
        with self.cond:
            entry = self.traffic.setdefault((round_, island_id), [0, 0])
            entry[0] += up
            entry[1] += down
            if elements:
                self.pace.arrived(island_id, round_, elements, self.clock())

    def count_down(self, round_: int, island_id: str, n: int) -> None:
        self._count(round_, island_id, down=n)

    # --- reading the parameters ---------------------------------------------------

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float, ranges: list[FlatRange] | None = None,
                        interrupted: Callable[[], bool] = lambda: False) -> float:
        """Blocks until round_ has closed; returns the seconds it waited. Refuses at once if the island's push of
        these ranges (all of the fragment, when None) is not here: after a restart every rank pushes its own again.
        Returns early once interrupted() holds, looked at whenever cond is notified (the caller was revoked)."""
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, round_)
            if round_ > self.round:
                raise Refused(
                    Reason.ROUND_AHEAD,
                    f"{self.label}round {round_} is ahead of the coordinator's round {self.round} "
                    "(it restarted from a checkpoint); resync", current_round=self.round,
                )
            mine = self.contributions.get(island_id)
            if self.round == round_ and self.phase is Phase.OPEN and (mine is None or not mine.coverage.covers(ranges)):
                raise Refused(
                    Reason.PUSH_AGAIN,
                    f"no contribution from {island_id} in {self.label}round {round_} (the coordinator may have restarted); push again",
                    current_round=self.round,
                )
            started = self.clock()
            if not self.cond.wait_for(lambda: interrupted() or self.round > round_ or self.phase is Phase.FINISHED or (
                    self.streaming is not None and self.streaming.round > round_), timeout_s):
                raise Refused(Reason.STILL_OPEN, f"{self.label}round {round_} still open after {timeout_s:.0f}s", current_round=self.round)
            return self.clock() - started

    @contextmanager
    def reading(
        self, delta_from_round: int | None = None, want_mean: bool = False, ranges: list[FlatRange] | None = None,
        cancel: Callable[[], None] = lambda: None,
    ) -> Iterator[Reading]:
        """What a result of the fragment sends (publish.py Reading): its header; the delta chunks when the caller can
        take a delta, else the value messages; the last round's mean pseudo-gradient chunks when asked (eager
        updates); and, when the header's checksum is empty, the DeltaStream whose trailer completes it. With
        ranges, the header carries their checksum.

        Taken under the parameters' read lock, held only while it is taken: the caller sends it without the lock,
        at its client's pace, and the outer step never waits for that (the values are an immutable version,
        publish.py PublishedValues; cancel ends the caller's call should that version be dropped while it still
        reads it). A delta asked for while the next round's update is being made (apply) streams as it is made:
        the header then has no checksum and the caller sends the stream's trailer after the chunks (with ranges,
        their checksum: ranges_checksum_after).
        """
        reading = None
        with self.cond:
            stream = self.streaming
            if stream is not None and delta_from_round == stream.round - 1:
                reading = Reading(pb.ResultHeader(
                    round=stream.round, islands=stream.islands, tokens=stream.tokens, mode=pb.ResultHeader.DELTA,
                    codec=self.publication.codec.name, base_checksum=stream.base_checksum, fragment=self.index,
                ), delta=stream, mean=self.mean_chunks if want_mean else [], stream=stream)
        if reading is None:
            with self.param_lock.read():
                with self.cond:
                    reading = Reading(pb.ResultHeader(
                        round=self.round, checksum=self.checksum, run_finished=self.ctx.run_finished(),
                        islands=self.last_islands, mode=pb.ResultHeader.VALUES, codec="fp32", fragment=self.index,
                        tokens=self.last_tokens,
                    ))
                    pub, header = self.publication, reading.header
                    if delta_from_round is not None and delta_from_round == self.round - 1 and pub.delta_base:
                        header.mode, header.codec, header.base_checksum = pb.ResultHeader.DELTA, pub.codec.name, pub.delta_base
                        reading.delta = pub.delta_chunks  # a new list each round: never changed once published
                    reading.mean = self.mean_chunks if want_mean and delta_from_round == self.round - 1 else []
                if ranges is not None:
                    header.ranges_checksum = ranges_checksum(
                        (r.name, r.offset, pub.params[r.name].view(-1)[r.offset : r.end]) for r in ranges)
                    pub.release()
                if reading.delta is None:
                    reading.add_values(pub, cancel)
        try:
            yield reading
        finally:
            reading.done()

    def ranges_checksum_after(self, stream: DeltaStream, ranges: list[FlatRange]) -> str:
        """The ranges' checksum of the parameters a streamed update led to, once it was made (under the read lock,
        held only for the checksum: the caller sends it after)."""
        with self.param_lock.read():
            if self.round != stream.round:  # the run went on meanwhile (this island was dropped from a round)
                raise Refused(Reason.STILL_OPEN, f"{self.label}round {stream.round} is over; pull again", current_round=self.round)
            params = self.publication.params
            found = ranges_checksum((r.name, r.offset, params[r.name].view(-1)[r.offset : r.end]) for r in ranges)
            self.publication.release()
            return found

    # --- closing a round: close, then apply ------------------------------------------------

    def close_reason(self) -> str | None:
        """Why the current round may close now, or None. Caller holds cond."""
        if self.ctx.follows_leader:
            return self._following_close_reason()
        behind = self.late.waived(self.contributions) if self.late is not None else set()  # on time now: waited for
        live = [i for i in self.members.waited_for() if i not in behind]
        overdue = self.clock() - self.round_opened_at > self.cfg.rounds.deadline_s
        done = [i for i, c in self.contributions.items() if c.state == "complete"]
        quorum = min(self.guard.quorum(), self.cfg.rounds.max_islands)  # the first outer step's (diloco/robust.py)
        least = max(self.cfg.rounds.min_islands, quorum)
        slow = self._too_slow(live, done) if len(done) >= least else {}
        reason = close_reason(done, [i for i in live if i not in slow], self.dropped, overdue, least, self.cfg.rounds.max_islands)
        if reason is not None and slow:
            reason = f"every other live island contributed; {', '.join(sorted(slow))} pushing too slowly to wait for"
        if reason is None and done and self.clock() - self._last_wait_log > 10:
            if len(done) < quorum and self.cfg.rounds.min_islands < quorum:
                self._last_wait_log = self.clock()
                log.warning("%sround %d has %d contribution(s); the run's first outer step waits for robust.first_quorum=%d "
                            "(a lone first push has nothing to be judged against; a one-island run sets "
                            "robust.first_quorum=1)", self.label, self.round, len(done), quorum)
            elif overdue:
                self._last_wait_log = self.clock()
                log.warning("%sround %d is past its %gs deadline with %d of min_islands=%d contributions; still waiting",
                            self.label, self.round, self.cfg.rounds.deadline_s, len(done), least)
        return reason

    def _too_slow(self, live: list[str], done: list[str]) -> dict[str, float]:
        """The live islands still pushing this round whose own pace says they would hold it far beyond the others'
        (coordinator/stragglers.py); each logged once a round. Caller holds cond."""
        pending = [i for i in live if i not in done and i not in self.dropped]
        if not pending:
            return {}
        slow = self.pace.too_slow(self.round, pending, done, self.manifest.total_numel(), self.clock())
        for island, left in slow.items():
            if (island, self.round) not in self._slow_logged:
                self._slow_logged.add((island, self.round))
                log.warning("%sround %d: %s's push would take %s more at its own pace, beyond limits.push_pace_factor=%g "
                            "times the others' (+ push_idle_s); the round does not wait for it", self.label, self.round,
                            island, "forever" if math.isinf(left) else f"{left:.0f} s", self.cfg.limits.push_pace_factor)
        return slow

    def leader_closed(self, round_: int, islands: list[str]) -> None:
        """A following shard: the leading shard closed round_ with these islands' on-time contributions."""
        with self.cond:
            if self.leader_close is None or round_ >= self.leader_close.round:
                self.leader_close = LeaderClose(round_, frozenset(islands), self.clock())
            self.cond.notify_all()

    def _following_close_reason(self) -> str | None:
        """A following shard's close: once the leader closed this round, when every island it closed with has its
        contribution whole here too, not waiting for one whose push has not begun here within
        limits.shard_push_start_s (pushes go to every shard at once: such a member pushed to some shards only, and
        its contribution is dropped on all of them, coordinator/judging.py); or at the deadline, with what it has,
        when no word from the leader came (it is down: the shard judges alone). Caller holds cond."""
        done = {i for i, c in self.contributions.items() if c.state == "complete"}
        notice = self.leader_close
        if notice is not None and notice.round == self.round:
            # A member that did not push here last time gets no grace until it does (begin_push): else it would hold
            # every round of this shard that long.
            late_start = self.clock() - notice.at > self.cfg.limits.shard_push_start_s
            waited = [i for i in notice.islands if i not in self.dropped
                      and (i in self.contributions or not late_start and i not in self.absent)]
            if all(i in done for i in waited):
                self.absent = {i for i in notice.islands if i not in self.contributions}
                return "the leading shard closed the round"
        overdue = self.clock() - self.round_opened_at > self.cfg.rounds.deadline_s
        if overdue and (done or notice is not None and notice.round == self.round):
            return "deadline"
        return None

    def close(self, poll_s: float = 0.2) -> Closing | None:
        """Waits up to poll_s for the close condition; when it holds, stops taking pushes and returns what to fold."""
        with self.cond:
            if self.phase is not Phase.OPEN:
                return None
            reason = self.close_reason()
            if reason is None:
                self.cond.wait(poll_s)
                reason = self.close_reason()
                if reason is None:
                    return None
            self.phase = Phase.CLOSING
            incomplete = {i: self.contributions.pop(i) for i, c in list(self.contributions.items()) if c.state == "pending"}
            complete = [(i, self.contributions[i]) for i in self.members.order(self.contributions)]
            if self.late is not None:  # the incomplete ones' other streams may still come: folded late, into a later round
                self.late.hold(self.round, incomplete)
                complete += self.late.due(self.round, self.contributions, self.members.order)  # after the on-time ones
            else:
                for island_id, contribution in incomplete.items():
                    log.warning("%sround %d: %s's contribution was incomplete; dropped", self.label, self.round, island_id)
                    contribution.release()
            self.contributions.clear()
            return Closing(reason, complete, self.clock() - self.round_opened_at)

    def fold_ahead(self) -> bool:
        """While the round is open: folds the next contribution in canonical order if it is complete (FoldAhead);
        returns whether it folded one. Called by the round's driver between its close checks, so the
        accumulator is never folded ahead and closed at once."""
        with self.cond:
            if self.phase is not Phase.OPEN:
                return False
            nxt = self.ahead.next(self.contributions, self.members.waited_for())
        if nxt is None:
            return False
        self.ahead.fold(self.accumulator, self.codec, *nxt, self.manifest.total_numel(), self.ctx.pool)
        return True

    def step(self, poll_s: float = 0.2) -> Closed | None:
        """One driver step: if the round closes within poll_s, applies it; else folds ahead and runs the idle hooks."""
        closing = self.close(poll_s)
        if closing is None:
            self.fold_ahead()  # the contributions in so far, while the others are still pushing
            Hooks.run(self.hooks.idle, self)
            return None
        return self.apply(closing)

    def apply(self, closing: Closing) -> Closed:
        """Judge, fold, outer step, open the next round, after-close hooks; returns what closed."""
        Hooks.run(self.hooks.closing, self, closing)
        verdict = self.judge(self, closing)
        kept = aggregate.kept(closing.contributions, verdict)
        closed = Closed(round_summary(self.round, self.index, kept, self.manifest.total_numel(), self.cfg), closing=closing,
                        kept=kept, skipped=not aggregate.takes_step(kept))
        closed.summary.clipped.extend(verdict.clipped)
        self.dropped.update(verdict.dropped)
        self.publication.release_values()
        folded = self._fold(closed, verdict)
        step = no_step if closed.skipped else self.outer_step
        # Step, publication and round change happen under the write lock, so no
        # reader ever sees new parameters under an old round number or the reverse.
        self.param_lock.acquire_write()
        try:
            before_s = Hooks.run(self.hooks.stepping, self, closed)  # the eager mean, before the step overwrites it
            stream = step(self, closed, before_s)
            closed.summary.closed_at = time.time()
            self._open_next(closed, folded, stream)
        finally:
            self.param_lock.release_write()
        self.last_close_reason = closing.reason  # logged once the round is evaluated (coordinator/hooks.py Summaries)
        Hooks.run(self.hooks.closed, self, closed)
        return closed

    def _fold(self, closed: Closed, verdict: Verdict) -> int:
        """The round's contributions into the accumulator: those folded while it was open kept when they are what
        aggregate.fold would fold first (FoldAhead.take), the rest from the spools; returns the elements folded."""
        summary, contributions, numel = closed.summary, closed.closing.contributions, self.manifest.total_numel()
        summary.wait_s, started = closed.closing.waited_s, time.perf_counter()
        ahead = self.ahead.take(self.accumulator, contributions, verdict)
        for _, contribution in contributions[:ahead]:
            contribution.release()
        folded = aggregate.fold(self.accumulator, self.codec, contributions[ahead:], verdict, numel,
                                self.outer_step.split_late, self.ctx.pool)
        summary.fold_s, summary.folded_ahead = time.perf_counter() - started, ahead
        return folded + ahead * numel

    def _open_next(self, closed: Closed, folded: int, stream: DeltaStream | None) -> None:
        """The round change: the summary completed, the settling hooks (ledger, membership), the next round opened
        (FINISHED after the last). Caller holds the write lock."""
        summary, contributors = closed.summary, {i for i, _ in closed.closing.contributions}
        with self.cond:
            self.traffic = traffic_into(summary, self.traffic, self.round)
            summary.checksum = self.checksum
            summary.seconds = self.clock() - self.round_opened_at
            summary.dropped.extend(sorted(self.dropped))
            summary.elements_folded = folded
            summary.elements_expected = self.manifest.total_numel() * len(closed.kept)
            self._count_restart_cost()
            Hooks.run(self.hooks.settling, self, closed)
            self.last_islands = len(contributors)  # an island may be in it on time and late
            self.last_tokens, self.last_round_s = summary.tokens, summary.seconds
            self.accumulator.reset()
            self.dropped.clear()
            self.round += 1
            self.pace.forget_before(self.round)
            self._slow_logged = {k for k in self._slow_logged if k[1] >= self.round}
            self.round_opened_at = self.clock()
            if self.late is not None:
                self.late.opened(self.round, self.checksum)
            self.phase = Phase.FINISHED if self.round >= self.cfg.rounds.rounds else Phase.OPEN
            # Decided with the phase change, so exactly one fragment's summary finishes the run.
            summary.run_finished = closed.run_finished = self.ctx.run_finished()
            closed.total_rounds = self.ctx.rounds_closed()
            if stream is not None:
                self.streaming = None
                stream.finish(self.checksum, summary.run_finished)
            self.cond.notify_all()

    def _count_restart_cost(self) -> None:
        """The first round closed since a restart: count what the restart cost. Caller holds cond."""
        if self.restored_round is not None:
            events = self.members.events
            events.rounds_lost += max(0, self.max_round_seen - self.restored_round)
            events.recovery_s += self.clock() - self.restored_at
            self.restored_round = None

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The fragment's round and outer state (its parameters are saved by the caller, whole-model)."""
        return {
            # Copied: another fragment's driver may step while the checkpoint is written.
            "round": self.round, "last": [self.last_islands, self.last_tokens], "outer": copy.deepcopy(self.outer.state_dict()),
            "published": self.publication.state_dict(), "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict, finished: bool) -> None:
        """Restores a checkpoint's round (its outer parameters already copied in); the round reopens now."""
        self.outer.load_state_dict(state["outer"], delayed=self.cfg.rounds.late_mode == "delayed_nesterov")
        self.outer_step = outer_step_for(self.cfg, self.outer, self.publication)
        self.accumulator.reset()
        self.ahead.reset()
        self.publication.load_state_dict(state["published"])
        self.guard.load_state_dict(state.get("guard", {}))
        with self.cond:
            now = self.clock()
            self.round = state["round"]
            self.phase = Phase.FINISHED if finished or self.round >= self.cfg.rounds.rounds else Phase.OPEN
            self.round_opened_at = self.restored_at = now
            if self.late is not None:
                self.late.restore(self.round, self.checksum)
            self.restored_round = self.round
            self.last_islands, self.last_tokens = state["last"]


# === 3. Folding ahead ========================================================================================


class FoldAhead:
    """The contributions of the open round folded already, in canonical order (module docstring)."""

    def __init__(self, order: Callable[[Iterable[str]], list[str]] = canonical_order) -> None:
        self.order = order  # the run's canonical order of island ids (Membership.order)
        self.done: list[tuple[str, Contribution]] = []
        self.broken = False  # a fold ahead failed part-way: the close starts over

    def reset(self) -> None:
        self.done, self.broken = [], False

    def next(self, contributions: dict[str, Contribution], waited_for: list[str]) -> tuple[str, Contribution] | None:
        """The contribution to fold now, if the one next in canonical order among the islands that may still contribute
        on time is complete. Caller holds the round's condition."""
        if self.broken:
            return None
        order = self.order(set(waited_for) | set(contributions))
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
        """Folds one contribution as aggregate.fold would (factor 1, on time); its spools stay for a close that starts
        over."""
        try:
            aggregate.fold_one(accumulator, codec, contribution, 1.0, numel, False, pool)
        except (OSError, SpoolCorrupt) as e:  # dropped meanwhile (spool gone), or the disk: the close decides
            log.warning("folding %s ahead of the close failed (%s); the close folds the round from the spools", island, e)
            self.broken = True
            return
        self.done.append((island, contribution))

    def take(self, accumulator: PseudoGradientAccumulator, contributions: list[tuple[str, Contribution]], verdict: Verdict) -> int:
        """How many of the closing round's first contributions the accumulator holds, folded exactly as aggregate.fold
        would fold them; when it holds anything else, resets it and returns 0."""
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


# === 4. The driver ===========================================================================================


class RoundDriver:
    """One thread per fragment: steps its rounds (FragmentRounds.step: the close, apply and the hooks around it). A
    fragment's driver ends when its rounds are done, the run finished, or stop is set."""

    def __init__(self, fragments: list[FragmentRounds], stop: threading.Event, poll_s: float = 0.2):
        self.fragments, self.stop, self.poll_s = fragments, stop, poll_s
        self.threads = [threading.Thread(target=self._drive, args=(f,), name=f"round-driver-{f}", daemon=True)
                        for f in range(len(fragments))]

    def start(self) -> RoundDriver:
        for thread in self.threads:
            thread.start()
        return self

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until every fragment's driver ended (or timeout_s passed); returns whether they all did."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self.threads)

    def _drive(self, fragment: int) -> None:
        f = self.fragments[fragment]
        while not self.stop.is_set():
            closed = f.step(self.poll_s)
            if closed is None:
                if f.phase is Phase.FINISHED:
                    return  # this fragment is done; the others' drivers go on
                continue
            if closed.run_finished:
                return
