"""The island's side of an outer round, read top to bottom: when a round ends, the exchange, the landing.

One object, `IslandRound`, does it for every island kind. It is handed the
island's parts (islands/context.py IslandContext: model, optimizer, position,
replica groups, fault points) and a `Wire`, and is driven once a step by any
loop (islands/island.py's, or a user's own): `boundary()` between steps (a
landing, or a sync), `step_begins()` before one, `reduce_gradients` inside it,
`after_step()` after the optimizer stepped; then `finish()`. The rest happens
here:

- When a round ends (`RoundPace`, and `RoundSchedule` over it): the run's fixed schedule (the default:
  fragment f pushes round r after a fixed number of inner steps counted across
  the run, diloco/fragments.py); the island's own H (`diloco-island join
  --steps-per-round N`, P = 1 only); or time-boxed (`rounds.mode = "time"`):
  the island trains from its round's first inner step until `rounds.round_s`
  seconds of its own wall time have passed, at least `inner.min_steps` and at
  most `inner.max_steps` steps, so a fast island does more steps instead of
  waiting for a slow one. The clock is the island's own (no clock is shared
  with the coordinator), less the time blocked on a round's result; the ranks
  of a sharded island agree on the largest elapsed time, and replica groups on
  the mean their gradient all-reduce carries, so every rank of every group ends
  the round at the same step. With streaming fragments each fragment has its
  own clock. The lr schedule position of each step and the claim bounds are in
  diloco/pace.py, which the coordinator reads too.
- The exchange (`begin`, then `push`, `pull` for one rank): at fragment f's
  sync step every rank takes its part of the fragment's pseudo-gradient
  (theta_global_f - theta_local_f, fp32, its own shard). The ranks of the
  pushing replica group (every rank, with one group) stream their shards,
  addressed by name and flat offset; the coordinator counts the island's
  contribution once every element arrived exactly once. Ranks of other groups
  encode the same chunks without sending them, so their error feedback moves
  exactly like the pusher's. Then every rank pulls the round's result for its
  ranges. Blocking (tau = 0): the push part runs inline and the pull waits for
  the landing, after the groups agreed the push went through. Overlapped
  (tau > 0): the pseudo-gradient is snapshotted, and push and pull run on a
  thread of their own while inner steps go on; the pull writes into a staging
  copy, so what a checkpoint or a healing peer reads of theta_global is never
  half-written. The landing comes tau steps later. Which of them (and eager
  updates over an overlapped one) is one object chosen at the start
  (`exchange_mode`: `Blocking`, `Overlapped`, `Eager`).
- The landing (`land`), a resync (`resync`), a rewind (`_rewind`) and the
  finish (`finish`): every one runs on every rank of every replica group at
  the same step, so the agreements (within a group with torch.distributed,
  across the groups through torchft: islands/replicas.py `ReplicaGroups`) line
  up. The outcome every rank agrees on is islands/outcome.py's `Next`,
  MAX-reduced.

What a replica group that dies or heals while a fragment's exchange is in flight does:

- Only the group that was rank 0 of the quorum at the sync pushes; the others
  encode the same chunks (their error feedback moves alike) and, overlapped,
  pull in the background, waiting for the pusher's copy to arrive.
- At the landing the groups agree on the push outcome in a torchft step. If
  the pushing group died before reporting, nobody reports a push: the
  quorum's new rank-0 group pushes from its own snapshot of the
  pseudo-gradient (bit-identical across groups); what its predecessor
  delivered is refused as a duplicate, which counts as delivered, so the
  round gets the island's contribution exactly once, and the waiting pulls
  complete. The landing is then agreed again at the next step.
- A group that heals meanwhile receives, with the model shard, optimizer
  state and theta_global (never half-written: overlapped pulls write into a
  staging copy), the exchanges in flight and their pseudo-gradient
  snapshots; it pulls at the landing, and can take a push over like any group.
- Fragments always sync and land in index order at the same steps in every
  group, so no two groups ever wait on different fragments' collectives.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from diloco.config import RunConfig
from diloco.pace import lr_position, max_round_steps, paced
from diloco.streaming import EagerState, eager_gradient, mix_, swap_estimate_
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.codec import Codec
from diloco.wire.feedback import ErrorFeedback
from diloco.wire.frames import Chunk, chunk_of, fp32_payload
from diloco.wire.messages import chunk_spans
from diloco.wire.refusal import Reason, reason_of
from islands.client import CoordinatorClient, MeanBuffer, RegeneratingChunks
from islands.context import FragmentShard, IslandContext
from islands.evidence import digest
from islands.memwatch import PeakRss
from islands.outcome import Next, next_step, reason_name

log = logging.getLogger(__name__)

_PULL_WAIT_S = 10.0  # a pull waits at most this long per call, then looks whether it was cancelled


# --- when a round ends ------------------------------------------------------------------------------------


class PaceError(ValueError):
    """An island setting that cannot work with this run; the message says which."""


class RoundPace:
    """When this island's rounds end; in time mode, one clock per fragment.

    A fragment's time box counts the island's own time from the round's first
    inner step, less the time spent blocked on a round's result (`blocked()`:
    seconds so far): with an overlapped exchange (streaming.tau > 0) the landing
    falls inside the next round, and a box that counted the wait would shrink
    the round to its minimum behind every slow close. With P fragments, a
    fragment's first round here is (H - o_f) / H of round_s, as its first round
    is H - o_f steps on the fixed schedule, so the syncs stay spread.
    """

    def __init__(self, cfg: RunConfig, own_steps: int = 0, blocked: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic):
        h, p = cfg.inner.steps_per_round, cfg.streaming.fragments
        if own_steps and p > 1:
            raise PaceError("--steps-per-round works with streaming.fragments = 1 only (fragment offsets are steps within the run's H)")
        if own_steps < 0 or own_steps > max_round_steps(cfg) - cfg.streaming.overlap:
            raise PaceError(f"--steps-per-round {own_steps} must be in 1..max(inner.steps_per_round, inner.max_steps) = "
                            f"{max_round_steps(cfg) - cfg.streaming.overlap} (the coordinator refuses larger claims)")
        # An island with its own H keeps it in time mode too: it opts out of the clock.
        self.time_boxed = cfg.rounds.mode == "time" and not own_steps
        self.custom = paced(cfg, own_steps)  # rounds end by this island's own count or clock
        self.steps = own_steps or h
        self.round_s = cfg.rounds.round_s
        self.first_s = [cfg.rounds.round_s * (h - f * h // p) / h for f in range(p)]  # o_f = f * H // P (diloco/fragments.py)
        self.first = [True] * p
        self.min_steps, self.max_steps = cfg.inner.min_steps, cfg.inner.max_steps or h
        self.blocked, self.clock = blocked, clock
        self.started = [clock()] * p
        self.blocked_at_start = [0.0] * p

    def begin_round(self, f: int = 0) -> None:
        """Fragment f's round's first inner step starts now: its time box counts from here."""
        self.started[f], self.blocked_at_start[f] = self.clock(), self.blocked()

    def synced(self, f: int) -> None:
        self.first[f] = False

    def elapsed(self, f: int = 0) -> float:
        """Seconds of fragment f's round so far, less those blocked on a result."""
        return self.clock() - self.started[f] - (self.blocked() - self.blocked_at_start[f])

    def due(self, steps: int, elapsed_s: float, f: int = 0) -> bool:
        """Whether fragment f's round of `steps` inner steps over `elapsed_s` seconds ends now (custom paces only)."""
        if not self.time_boxed:
            return steps >= self.steps
        box = self.first_s[f] if self.first[f] else self.round_s
        return steps >= self.max_steps or (steps >= self.min_steps and elapsed_s >= box)

    def state_dict(self) -> dict:
        """What a healing replica group adopts: the fragments' elapsed times and which first rounds are done."""
        return {"elapsed": [self.elapsed(f) for f in range(len(self.first))], "first": list(self.first)}

    def load_state_dict(self, state: dict) -> None:
        now, blocked = self.clock(), self.blocked()
        self.started = [now - e for e in state["elapsed"]]
        self.blocked_at_start = [blocked] * len(self.started)
        self.first = list(state["first"])


# --- what one rank exchanges ------------------------------------------------------------------------------


@dataclass
class Wire:
    """How this rank talks to the coordinator."""

    client: CoordinatorClient
    codec: Codec
    chunk_bytes: int
    feedback: ErrorFeedback | None
    pull_timeout_s: float
    island_id: Callable[[], str]
    codecs: dict[str, Codec] = field(default_factory=dict)  # what it may push with, by name (wire.link_codecs)
    down: Codec | None = None  # the downlink's codec: eager updates' mean pseudo-gradient arrives in it

    def codec_for(self, ex: "Exchange") -> Codec:
        """The codec of this exchange's push: the one advised for its fragment when it started, else the run's."""
        return self.codecs.get(ex.codec, self.codec)


@dataclass
class Exchange:
    fragment: int
    round: int
    pushed_step: int  # inner steps completed at the sync
    due: int  # inner steps completed when it lands
    tokens: int
    inner_steps: int
    train_loss: float
    checksum: str  # of the global parameters the round was trained from
    pusher: bool  # this rank's group pushes
    samples: list[tuple[int, int]] = field(default_factory=list)  # token corpus: the sample positions trained on
    first_step: int = -1  # the lr schedule position of its first inner step (-1: pushed_step - inner_steps)
    folded_into: int = -1  # rounds.late_rounds: the later round the coordinator folds this late push into
    codec: str = ""  # compression per link: the codec it pushes with, fixed at the sync ("": the run's)
    leases: int = 0  # the island's leases_forgotten when its samples were named (islands/state.py forget_leases)
    pg: dict[str, torch.Tensor] | None = None  # snapshot of the pseudo-gradient shard (overlapped exchanges)
    staging: dict[str, torch.Tensor] | None = None  # where an overlapped pull writes theta_global_f
    estimate: dict[str, torch.Tensor] | None = None  # eager: the provisional global trained from meanwhile
    mean: MeanBuffer | None = None  # eager: where the round's mean pseudo-gradient arrives
    status: Next | None = None  # the push's outcome (Next.NOBODY on ranks that do not push)
    outcome: pb.ResultHeader | BaseException | None = None  # the pull's result or error
    held_s: float = 0.0  # seconds the coordinator held our pulls for other islands
    started_at: float = 0.0
    finished_at: float = 0.0
    landed_at: float = 0.0
    pushed: threading.Event = field(default_factory=threading.Event, repr=False)  # status is known
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)

    @property
    def background(self) -> bool:
        return self.pg is not None

    def record(self) -> dict:
        return {
            "fragment": self.fragment, "round": self.round, "pushed_step": self.pushed_step, "due": self.due,
            "started_at": self.started_at, "finished_at": self.finished_at, "landed_at": self.landed_at,
        }

    def state_dict(self) -> dict:
        """What a healing peer needs to land this exchange (or take its push over)."""
        keys = ("fragment", "round", "pushed_step", "due", "tokens", "inner_steps", "train_loss", "checksum", "samples", "first_step",
                "codec", "leases")
        return {k: getattr(self, k) for k in keys} | {"pg": self.pg}


# --- one rank's exchange on the wire: push, pull, and the thread an overlapped exchange runs on ------------


def pg_chunks(shard: FragmentShard, ex: Exchange, wire: Wire, start: int = 0, keep: Collection[str] | None = None) -> Iterator[Chunk]:
    """The pseudo-gradient of this rank's shard as chunks, one chunk at a time; a pure function of the
    exchange (error feedback writes only its pending residual), so every resend is the same bytes.
    keep: only these parameters' chunks (a coordinator shard's), counted from start among themselves."""
    codec = wire.codec_for(ex)
    i = 0
    for r in shard.ranges:
        if keep is not None and r.name not in keep:
            continue
        for lo, hi in chunk_spans(r.numel, codec, wire.chunk_bytes):
            if i >= start:
                with torch.no_grad():  # runs on gRPC's thread, where grad mode is on
                    if ex.pg is not None:
                        piece = ex.pg[r.name][lo:hi]
                    else:
                        piece = shard.flat_global(r.name)[lo:hi] - shard.local[r.name][lo:hi].to("cpu", torch.float32)
                    if wire.feedback is not None:
                        payload = wire.feedback.encode(r.name, lo, piece, codec)
                    elif codec.name == "fp32":  # the piece's own bytes: the framing copies them once
                        payload = fp32_payload(piece)
                    else:
                        payload = codec.encode(piece)
                yield chunk_of(r.name, r.offset + lo, hi - lo, payload)
            i += 1


def push(shard: FragmentShard, ex: Exchange, wire: Wire) -> Next:
    """Streams this rank's shard; returns Next.DELIVERED or what the refusal calls for (a resync, REJOIN, RESET, RELEASE)."""
    if shard.numel() == 0:
        return Next.DELIVERED
    header = pb.PushHeader(
        island_id=wire.island_id(), round=ex.round, tokens=ex.tokens, train_loss=ex.train_loss, codec=wire.codec_for(ex).name,
        inner_steps=ex.inner_steps, global_checksum=ex.checksum, fragment=ex.fragment,
        samples=[pb.SampleRange(start=a, stop=b) for a, b in ex.samples],
        first_step=ex.first_step if ex.first_step >= 0 else max(0, ex.pushed_step - ex.inner_steps),
    )
    try:
        chunks = RegeneratingChunks(lambda start, keep: pg_chunks(shard, ex, wire, start, keep),
                                    names={r.name for r in shard.ranges if r.numel})
        response = wire.client.push(header, chunks)
        if response.late:  # delivered, for a later round: the pull brings the current global parameters
            ex.folded_into = response.folded_into
        return Next.DELIVERED
    except grpc.RpcError as e:
        status = next_step(e)
        fatal = status in (Next.FAIL, Next.WAIT)  # a push is never told to wait
        # Every refusal is in the island's own log, with its reason; REPLACED in the one line the island stops with.
        if status is not Next.DELIVERED and reason_of(e) != Reason.REPLACED:
            log.log(logging.ERROR if fatal else logging.WARNING, "%s: push of %sround %d refused: %s: %s",
                    header.island_id, _label(shard), ex.round, reason_name(e), e.details())
        if fatal:
            raise
        return status


def encode_only(shard: FragmentShard, ex: Exchange, wire: Wire) -> None:
    """What a rank of a group that does not push does instead: moves its error feedback the same way."""
    if wire.feedback is not None:
        for _ in pg_chunks(shard, ex, wire):
            pass


def pull(shard: FragmentShard, ex: Exchange, wire: Wire) -> pb.ResultHeader:
    """Waits for the round to close and brings this rank's ranges of theta_global_f to its result.

    A coordinator that lost our contribution (it restarted) gets the same chunks
    again from a pushing rank; a rank of another group waits for the pusher's
    copy to arrive. Raises the refusal that ends it; gives up waiting once the
    landing cancelled the exchange.
    """
    targets = ex.staging if ex.staging is not None else shard.global_
    pushes = 0
    while True:
        started = time.monotonic()
        try:
            header = wire.client.pull(
                wire.island_id(), ex.round, targets, shard.manifest, ex.checksum, timeout_s=min(wire.pull_timeout_s, _PULL_WAIT_S),
                ranges=shard.wire_ranges, fragment=ex.fragment, mean=ex.mean,
            )
            ex.held_s += header.held_s
            return header
        except grpc.RpcError as e:
            step = next_step(e)
            if ex.cancel.is_set() or step not in (Next.WAIT, Next.PUSH_AGAIN):
                raise
            if step is Next.WAIT:
                ex.held_s += time.monotonic() - started
                continue
            if not ex.pusher:  # the pushing group's copy has not arrived yet
                time.sleep(0.1)
                continue
            pushes += 1
            if pushes > 3:
                raise
            log.warning("%s: %s; pushing %sround %d again", wire.island_id(), e.details(), _label(shard), ex.round)
            if push(shard, ex, wire) != Next.DELIVERED:
                raise


def start_exchange(shard: FragmentShard, ex: Exchange, wire: Wire) -> None:
    """Runs the push part (pushers push, the others encode only); an overlapped exchange also pulls, on its thread."""

    def work() -> None:
        try:
            with torch.no_grad():
                if ex.pusher:
                    ex.status = push(shard, ex, wire)
                else:
                    encode_only(shard, ex, wire)
                    ex.status = Next.NOBODY
                ex.pushed.set()
                if ex.background and ex.status in (Next.DELIVERED, Next.NOBODY):
                    ex.outcome = pull(shard, ex, wire)
        except BaseException as e:  # handed to the training thread at the landing
            ex.outcome = e
            if ex.status is None:
                ex.status = Next.RESYNC
        ex.pushed.set()
        ex.finished_at = time.monotonic()

    ex.started_at = time.monotonic()
    if ex.background:
        ex.thread = threading.Thread(target=work, name=f"exchange-f{ex.fragment}-r{ex.round}", daemon=True)
        ex.thread.start()
    else:
        work()


def wait_exchange(ex: Exchange) -> None:
    if ex.thread is not None:
        ex.thread.join()
        ex.thread = None


def finish_pull(shard: FragmentShard, ex: Exchange, wire: Wire) -> None:
    """At the landing of a push that went through: a blocking exchange (or one a healing group received) pulls now,
    an overlapped one's thread is joined. The result, or the pull's error, is in ex.outcome."""
    if ex.thread is None and not isinstance(ex.outcome, (pb.ResultHeader, BaseException)):
        try:
            ex.outcome = pull(shard, ex, wire)
        except grpc.RpcError as e:
            ex.outcome = e
        ex.finished_at = time.monotonic()
    wait_exchange(ex)


def _label(shard: FragmentShard) -> str:
    return f"fragment {shard.index} "


# --- how an exchange overlaps training: one seam, chosen once from streaming.tau and streaming.eager --------


class Blocking:
    """tau = 0 (plain DiLoCo): the push runs inline at the sync, the pull at the landing, in the same step."""

    def __init__(self, alpha: float, feedback: ErrorFeedback | None):
        self.alpha, self.feedback = alpha, feedback

    def prepare(self, ex: Exchange, shard: FragmentShard, last: bool) -> None:
        """At the sync, before the push starts: what the exchange needs to run beside training (nothing here)."""

    def adopt(self, ex: Exchange, shard: FragmentShard, final: bool) -> float:
        """The round's result is in shard.global_: mixes it into theta_local (pure adoption when the island stops
        here). Returns the residual kept in the local shard (sum of magnitudes; 0 unless wire.feedback_in_model)."""
        mix_(shard.local, shard.flat, 0.0 if final else self.alpha)
        if final or self.feedback is None or not self.feedback.in_model:
            return 0.0
        # What the codec did not send stays in this island's parameters.
        self.feedback.keep_residual_(shard.local, 1.0 - self.alpha)
        return sum(self.feedback.buffers[n].abs().sum().item() for n in shard.local)

    def forget(self, f: int) -> None:
        """Fragment f resynced or rewound: nothing provisional to forget."""


class Overlapped(Blocking):
    """tau > 0 (Streaming DiLoCo): the pseudo-gradient snapshotted, push and pull on a thread of their own while
    inner steps go on, the landing tau steps later; the pull writes into a staging copy. The run's last round
    blocks (nothing is left to train meanwhile)."""

    def __init__(self, alpha: float, feedback: ErrorFeedback | None, tau: int):
        super().__init__(alpha, feedback)
        self.tau = tau

    def prepare(self, ex: Exchange, shard: FragmentShard, last: bool) -> None:
        if last:
            return
        ex.due = ex.pushed_step + self.tau
        ex.pg = {r.name: shard.flat_global(r.name) - shard.local[r.name].to("cpu", torch.float32) for r in shard.ranges}
        ex.staging = {n: g.clone() for n, g in shard.global_.items()}


class Eager(Overlapped):
    """Overlapped, and meanwhile the island trains from an estimate of the round's result (diloco/streaming.py):
    the last round's mean pseudo-gradient with its own fresh one in place of its stale one, stepped by its replica
    of the coordinator's momentum; the landing swaps the estimate for the exact result."""

    def __init__(self, alpha: float, feedback: ErrorFeedback | None, tau: int, eager: list[EagerState], down: Codec):
        super().__init__(alpha, feedback, tau)
        self.eager, self.down = eager, down

    def prepare(self, ex: Exchange, shard: FragmentShard, last: bool) -> None:
        super().prepare(ex, shard, last)
        eager = self.eager[ex.fragment]
        if not ex.background:
            return
        ex.mean = MeanBuffer({n: torch.zeros_like(t) for n, t in ex.pg.items()}, shard.manifest, self.down, shard.wire_ranges)
        if eager.prev_mean is not None:
            ex.estimate = eager.replica.step(shard.flat, eager_gradient(eager.prev_mean, eager.prev_own, ex.pg, eager.share))
            mix_(shard.local, ex.estimate, self.alpha)

    def adopt(self, ex: Exchange, shard: FragmentShard, final: bool) -> float:
        header, eager = ex.outcome, self.eager[ex.fragment]
        carried = 0.0
        if ex.estimate is not None and not final:
            swap_estimate_(shard.local, shard.flat, ex.estimate, self.alpha)
        else:
            carried = super().adopt(ex, shard, final)
        if ex.mean is not None and ex.mean.complete and header.tokens > 0 and header.round == ex.round + 1:
            eager.replica.advance(ex.mean.tensors)
            eager.prev_mean, eager.prev_own, eager.share = ex.mean.tensors, ex.pg, min(1.0, ex.tokens / header.tokens)
        else:
            eager.forget()
        return carried

    def forget(self, f: int) -> None:
        self.eager[f].forget()


def exchange_mode(cfg: RunConfig, feedback: ErrorFeedback | None, eager: list[EagerState] | None, down: Codec | None) -> Blocking:
    """The island's exchanges: blocking, overlapped or eager, for the whole run."""
    s = cfg.streaming
    if s.eager:
        return Eager(s.alpha, feedback, s.overlap, eager, down)
    return Overlapped(s.alpha, feedback, s.overlap) if s.overlap > 0 else Blocking(s.alpha, feedback)


# --- pacing: whether a round is over, the lr's position, the clock every rank agrees on ---------------------


class RoundSchedule:
    """When each fragment's round ends at this island, read the same on every rank of every group: the run's fixed
    schedule, the island's own H, or time boxes (RoundPace) on a clock the ranks and groups agree on."""

    def __init__(self, ctx: IslandContext, inflight: dict[int, Exchange], clock: Callable[[], float] = time.monotonic):
        self.ctx, self.state, self.inflight = ctx, ctx.state, inflight
        self.p, self.h = len(ctx.fragments), ctx.cfg.inner.steps_per_round
        # A time box does not count the time blocked on a result.
        self.pace = RoundPace(ctx.cfg, ctx.spec.steps_per_round, blocked=lambda: ctx.timing["wait_s"], clock=clock)
        self.fixed = not self.pace.custom  # rounds end on the run's fixed schedule
        self.push_first = self.pace.time_boxed and self.p > 1  # a due push never waits behind a landing
        self.shared_clock = ctx.spec.groups > 1 or ctx.world.world_size > 1  # the ranks agree on the clock
        self.agreed_clock: tuple[int, list[float]] = (-1, [])  # (step, fragment clocks) every rank and group agreed on
        # Fragments whose round starts later than where the island trains from (defer_starts): step -> its start.
        self.deferred: dict[int, int] = {}

    def lr_step(self) -> int:
        """The inner lr schedule's position of this step: the run-wide step on the fixed schedule; with a pace of the
        island's own, its step within the round it trains for, placed on that round's positions (diloco/pace.py)."""
        s = self.state
        if self.fixed:
            return s.step
        round_ = s.rounds[0] + (0 in self.inflight)  # during an overlapped exchange it trains for the next round
        return lr_position(round_ * self.h, s.step - s.last_sync[0], self.ctx.cfg)

    def round_over(self, f: int) -> bool:
        """Whether fragment f's round ends at this step (every rank agrees)."""
        s = self.state
        if self.fixed:
            return s.step >= self.ctx.layout.round_end(f, s.rounds[f], self.ctx.total_rounds)
        if self.push_first and f != self._turn():
            return False
        elapsed = self._clock()[f] if self.pace.time_boxed and s.step > s.last_sync[f] else 0.0
        return self.pace.due(s.step - s.last_sync[f], elapsed, f)

    def is_last(self, f: int) -> bool:
        """Fragment f's round ending now is the run's last."""
        s = self.state
        return s.rounds[f] >= self.ctx.total_rounds - 1 if self.pace.custom else s.step >= self.ctx.total_rounds * self.h

    def _turn(self) -> int:
        """The fragment whose sync comes next. Time-boxed, islands of different speeds must still push fragments in one
        order, the fixed schedule's: by round, and within a round from fragment P - 1 (the largest offset) down to 0.
        Otherwise island A could wait on fragment 0's round while owing fragment 1's, which B waits on while owing
        fragment 0's: a deadlock until the deadline (torchft's streaming saw the same fragment-order deadlock)."""
        s, p = self.state, self.p
        pending = [f for f in range(p) if s.rounds[f] < s.stop_round]
        return min(pending, key=lambda f: (s.rounds[f] + (f in self.inflight), p - 1 - f), default=0)

    def _clock(self) -> list[float]:
        """The fragments' elapsed round times as every rank of every replica group sees them at this step.

        One rank: its own clock. One group of several ranks: the largest of their clocks, reduced once a step.
        Several groups: what the last committed step's gradient all-reduce carried (`clock_extra`), the same
        bits in every group, so all of them end a round at the same step."""
        s, spec = self.state, self.ctx.spec
        step, agreed = self.agreed_clock
        if step == s.step and self.shared_clock:
            return agreed
        values = [self.pace.elapsed(f) for f in range(self.p)]
        if not self.shared_clock:
            return values
        if spec.groups > 1:
            log.warning("group %d: no agreed round clock at step %d; counting the round from now", spec.group, s.step)
            values = [0.0] * len(values)
        else:
            values = self.ctx.group_reduce(values, dist.ReduceOp.MAX)  # the ranks' clocks differ: stop together
        self.agreed_clock = (s.step, values)
        return values

    def clock_extra(self) -> list[float]:
        """This rank's fragment clocks, to ride along the replica groups' gradient all-reduce (time mode, several groups)."""
        if not (self.pace.time_boxed and self.ctx.spec.groups > 1):
            return []
        return [self.pace.elapsed(f) for f in range(self.p)]

    def agree_clock(self, averaged: list[float]) -> None:
        """After a committed step: the groups' mean clocks (rank by rank), the largest over the group's ranks, is the
        clock of the next boundary everywhere."""
        if averaged:
            if self.ctx.world.world_size > 1:
                averaged = self.ctx.group_reduce(averaged, dist.ReduceOp.MAX)
            self.agreed_clock = (self.state.step + 1, averaged)  # the step about to complete

    def rounds_tag(self) -> float:
        """The fragments' rounds as one small whole number (below 4093, so its square is exact in fp32): groups that
        disagree on any of them are caught (up to a 1-in-4093 collision of the tags)."""
        return float(zlib.crc32(repr(self.state.rounds).encode()) % 4093)

    def round_begins(self, f: int) -> None:
        """Fragment f's round takes its first inner step now: its time box starts, and a start put off by
        defer_starts begins the round afresh from the global values, as a landing does."""
        self.pace.begin_round(f)
        if self.deferred.pop(f, None) is not None:
            mix_(self.ctx.fragments[f].local, self.ctx.fragments[f].flat, 0.0)
            self.state.restart_fragment(f)

    def defer_starts(self) -> None:
        """After the island moved to the earliest of its fragments' round starts (start_step): a fragment whose own
        round starts a whole round or more later begins it there, as its landing would have begun it, not now. That
        happens when a restarted coordinator's fragments are out of their schedule's order (one closed a round the
        other lost): counted from now, that fragment's round would claim more inner steps than a round holds, and be
        refused. The steps before its start train it for nothing; at its start its local values go back to the
        global ones (round_begins)."""
        s, layout, total = self.state, self.ctx.layout, self.ctx.total_rounds
        self.deferred = {}
        if self.pace.custom:
            return
        for f in range(self.p):
            begin = layout.round_start(f, s.rounds[f], total)
            if s.rounds[f] < total and begin - s.step >= self.h:
                s.last_sync[f] = self.deferred[f] = begin

    def align_step(self, f: int) -> None:
        """After adopting a round more than one ahead (a resync, a late fold), plain DiLoCo's fixed schedule would make
        the island train several rounds' steps in one: move the step counter (and the round's start with it) to the
        round's start, so the round holds H steps and trains at its own lr. After adopting a round whose end it has
        already passed (its push for that round was not taken: leases the restarted coordinator does not know, a
        checksum that diverged), it trains the round again instead of pushing an empty contribution to it."""
        s, layout, total = self.state, self.ctx.layout, self.ctx.total_rounds
        if self.pace.custom or self.p > 1:
            return
        start = layout.round_start(f, s.rounds[f], total)
        redo = s.rounds[f] < s.stop_round and s.step >= layout.round_end(f, s.rounds[f], total) > start
        shift = start - s.step if redo else max(0, start - s.step)
        s.step += shift
        s.last_sync[f] += shift

    def state_dict(self) -> dict:
        """The round's clock, for a healing group: the agreed one and the pace's."""
        return {"agreed": list(self.agreed_clock), "pace": self.pace.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        step, agreed = sd["agreed"]
        self.agreed_clock = (int(step), list(agreed))
        self.pace.load_state_dict(sd["pace"])


# --- the island's side of the round -----------------------------------------------------------------------


class IslandRound:
    """The island's side of every fragment's rounds: when one ends, its exchange, its landing, a resync, the finish.

    Driven once a step, from the island's loop or any other (every call on every rank of every replica group at
    the same step):

        rounds.start()
        while not rounds.done():
            if rounds.boundary():                    # a landing, or a sync that blocks: this step is used
                continue
            lr_step = rounds.step_begins()           # before the forward pass
            loss = ...                               # forward, backward, rounds.reduce_gradients, optimizer.step()
            rounds.after_step(loss, tokens, samples)
        rounds.finish()
    """

    def __init__(self, ctx: IslandContext, wire: Wire, clock: Callable[[], float] = time.monotonic):
        self.ctx, self.wire = ctx, wire
        # The context's parts the round uses throughout (objects it never replaces).
        self.state, self.fragments, self.replicas = ctx.state, ctx.fragments, ctx.replicas
        self.evidence, self.faults, self.timing = ctx.evidence, ctx.faults, ctx.timing
        self.inflight: dict[int, Exchange] = {}
        self.schedule = RoundSchedule(ctx, self.inflight, clock)
        self.mode = exchange_mode(ctx.cfg, ctx.feedback, ctx.eager, wire.down)  # blocking, overlapped or eager
        self.losses: list[float] = []  # the mean inner loss of each round's steps (of each H steps on the fixed schedule)
        self._window: list[float] = []
        self.memory: list[dict] = []  # with spec.measure_memory: each sync's peak RSS
        self.late_folds = 0  # pushes the coordinator folded into a later round (rounds.late_rounds)
        self.takeovers = 0
        self.final_checksum = ""  # what the coordinator said of our parameters at leave

    @property
    def pace(self) -> RoundPace:
        return self.schedule.pace

    # --- start: fetch theta_global; a resumed island keeps the fragments it has right ----------------

    @torch.no_grad()
    def start(self, restored: bool | None = None) -> None:
        """Fetches theta_global. A resumed island (restored: from a checkpoint; default the context's word) keeps the
        fragments whose round and checksum are the coordinator's and resyncs the others."""
        s, params = self.state, self.ctx.params
        restored = self.ctx.restored if restored is None else restored
        into = params.global_ if not restored else {n: torch.empty_like(t) for n, t in params.global_.items()}
        header = self._fetch_all(into)
        rounds = [f.round for f in header.fragments] or [header.round]
        sums = [f.checksum for f in header.fragments] or [header.checksum]
        adopt = [f for f, (r, c, mine, own) in enumerate(zip(rounds, sums, s.rounds, s.checksums))
                 if not restored or (r, c) != (mine, own)]
        s.finished = s.finished or header.run_finished
        if not adopt:
            return
        if restored:
            log.warning("%s: checkpoint is at fragment rounds %s, the coordinator at %s; resyncing %s",
                        s.island_id, s.rounds, rounds, adopt)
        for f in adopt:
            for name, t in self.fragments[f].global_.items():
                if restored:
                    t.copy_(into[name])
            s.rounds[f], s.checksums[f] = rounds[f], sums[f]
        s.step = self.ctx.layout.start_step(s.rounds, self.ctx.total_rounds)
        for f in range(len(self.fragments)):
            s.restart_fragment(f)
        for f in adopt:
            mix_(self.fragments[f].local, self.fragments[f].flat, 0.0)  # theta_local <- theta_global
        self.schedule.defer_starts()

    def _fetch(self, into: dict[str, torch.Tensor], shard: FragmentShard, fragment: int | None = None) -> tuple[pb.ResultHeader, bool]:
        """theta_global of the shard's ranges into `into`, fetched again (at most 5 times) until every rank of the group
        has the same round; the header, and whether they do."""
        for _ in range(5):
            header = self.ctx.client.fetch(self.state.island_id, into, shard.manifest, shard.wire_ranges, fragment=fragment)
            lo, hi = self.replicas.reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                return header, True
            log.warning("ranks fetched different rounds (%d..%d); fetching again", -lo, hi)
        return header, False

    def _fetch_all(self, into: dict[str, torch.Tensor]) -> pb.ResultHeader:
        """Every fragment's global parameters (this rank's ranges), the same round on every rank of the group."""
        header, same = self._fetch(into, self.ctx.params)
        if not same:
            raise RuntimeError("the group's ranks could not fetch the same round of global parameters; is the coordinator restarting?")
        return header

    # --- the schedule: a boundary step, or an inner step between them ----------------------------------

    def done(self) -> bool:
        """The island has trained every round it will (or the run is over) and nothing is in flight: finish()."""
        return self.state.done() and not self.inflight

    def boundary(self) -> bool:
        """Lands an exchange that is due, or begins the syncs that are due. True when this step's commit was used.
        Time-boxed with fragments, a due push goes first: it never waits behind a landing."""
        s, push_first = self.state, self.schedule.push_first
        if not push_first and self.land_due():
            return True
        for f in range(len(self.fragments)):
            if f in self.inflight or s.rounds[f] >= s.stop_round or s.finished:
                continue
            if self.round_over(f):
                return self._sync(f)
        return push_first and self.land_due()

    def _sync(self, f: int) -> bool:
        """Fragment f's round ends here: its exchange begins, and a blocking one lands at once (True: this step is used)."""
        meter = PeakRss() if self.ctx.spec.measure_memory else nullcontext()
        with meter:
            round_ = self.state.rounds[f]
            if not self.schedule.fixed:
                self._close_window()
            self.begin(f)
            if self.inflight[f].due > self.state.step:
                return False
            self.land(f)
        if isinstance(meter, PeakRss) and meter.peak_bytes is not None:
            self.memory.append({"round": round_, "fragment": f, "peak_rss_bytes": meter.peak_bytes, "phases": meter.phases})
        return True

    def round_over(self, f: int) -> bool:
        """Whether fragment f's round ends at this step: the run's schedule, or this island's own pace (every rank agrees)."""
        return self.schedule.round_over(f)

    def lr_step(self) -> int:
        """The inner lr schedule's position of this step (RoundSchedule.lr_step)."""
        return self.schedule.lr_step()

    def step_begins(self) -> int:
        """An inner step starts now (its batch in hand): a fragment whose round it begins starts its time box. Returns
        the step's position on the inner lr schedule."""
        s = self.state
        for f in range(len(self.fragments)):
            if s.step == s.last_sync[f]:
                self.schedule.round_begins(f)  # the time box counts from the round's first inner step
        return self.schedule.lr_step()

    def reduce_gradients(self, model: torch.nn.Module, loss: float) -> float | None:
        """train_step's hook, after the backward pass: the gradients averaged across the replica groups, the
        fragments' rounds and the round clock riding along. None when the step did not commit (redo it); groups
        that found themselves in different rounds resync."""
        averaged = self.replicas.average_gradients(model, loss, self.schedule.rounds_tag(), self.schedule.clock_extra())
        if not averaged.committed:
            log.warning("group %d: inner step %d did not commit; redoing it", self.ctx.spec.group, self.state.step)
            for f in range(len(self.fragments) if averaged.disagreed else 0):
                self.resync(f, Next.RESYNC)
            return None
        self.schedule.agree_clock(averaged.clock)
        return averaged.loss

    def after_step(self, loss: float | None, tokens: int = 0, samples: int = 0) -> None:
        """After the optimizer stepped: the step's loss and tokens count toward every fragment's push, the data
        cursor moves on by the samples it read. Nothing when the step did not commit (loss None)."""
        if loss is None:
            return
        s = self.state
        for f in range(len(self.fragments)):
            s.loss[f][0] += loss
            s.loss[f][1] += 1
            s.tokens[f] += tokens
        s.step += 1
        s.consume(samples)
        self._window.append(loss)
        if self.schedule.fixed and s.step % self.schedule.h == 0:
            self._close_window()

    def _close_window(self) -> None:
        """The mean inner loss of the round's steps (every H steps; at each sync with a pace of the island's own)."""
        if not self._window:
            return
        s = self.state
        self.losses.append(sum(self._window) / len(self._window))
        self._window = []
        if self.ctx.cores is not None:  # islands that started or ended on this machine since move our share
            self.ctx.cores.apply()
        log.info("%s step %d: train loss %.4f, fragment rounds %s; %.1fs in inner steps, %.1fs waiting so far",
                 s.island_id, s.step, self.losses[-1], s.rounds, self.timing["compute_s"], self.timing["wait_s"])

    # --- a fragment's sync: the push now, the landing tau inner steps later ---------------------

    @torch.no_grad()
    def begin(self, f: int) -> None:
        """Fragment f's round ended here: each rank takes its shard of theta_global - theta_local and starts the exchange."""
        s, shard, c = self.state, self.fragments[f], self.state.step
        steps = c - s.last_sync[f]
        if steps <= 0:
            log.warning("%s: fragment %d is due with no inner step trained for it; pushing it with no weight", s.island_id, f)
        loss_sum, n = self.replicas.reduce([s.loss[f][0], s.loss[f][1]])
        ex = Exchange(
            f, s.rounds[f], c, c, tokens=s.tokens[f], inner_steps=max(steps, 1), train_loss=loss_sum / n if n else 0.0,
            checksum=s.checksums[f], pusher=self.replicas.leads(), samples=s.positions(s.data_marks[f], s.data_cursor),
            first_step=-1 if self.schedule.fixed else s.rounds[f] * self.schedule.h,  # its lr positions (diloco/pace.py)
            codec=s.codecs[f],  # compression per link: as last advised, fixed for this push
            leases=s.leases_forgotten,
        )
        self.mode.prepare(ex, shard, last=self.schedule.is_last(f))  # overlapped: the snapshot, the landing tau steps on
        log.debug("%s: fragment %d round %d pushes %d tokens of %d inner steps", s.island_id, f, ex.round, ex.tokens, ex.inner_steps)
        s.restart_fragment(f)
        self.pace.synced(f)  # its next time box is a whole round_s
        self.inflight[f] = ex
        if ex.pusher:  # tests: a pusher dying mid-push, or pushing late
            self.faults.hit("die-before-push", ex.round)
            self.faults.hit("hold-before-push", ex.round)
        start_exchange(shard, ex, self.wire)

    # --- landing: agree on the push, pull, mix the result in ------------------------------------------

    def land_due(self) -> bool:
        """Lands the first exchange in flight that is due (all of them once the island is done); True if there was one."""
        for f in sorted(self.inflight):
            if self.inflight[f].due <= self.state.step or self.state.done():
                return self.land(f) or True
        return False

    @torch.no_grad()
    def land(self, f: int) -> bool:
        """Lands fragment f's exchange; False when this step did not settle it (redo at the next step).

        The groups agree on the push's outcome (or one takes the push over); if it went through, every rank brings
        its ranges of the result, else the exchange is dropped; the group agrees on what it got, and the fragment
        mixes the result in (`_adopt`) or resyncs."""
        ex, waited = self.inflight[f], time.monotonic()
        outcome = self._agree_push(ex)
        if outcome is None:
            return False
        trouble = self._collect(ex) if outcome is Next.DELIVERED else self._drop(ex, outcome)
        got = ex.outcome.round if isinstance(ex.outcome, pb.ResultHeader) else -1
        worst, lo, hi = self.replicas.reduce([trouble, -got, got], dist.ReduceOp.MAX)
        del self.inflight[f]
        carried = 0.0  # sum |residual| kept in the local shard (wire.feedback_in_model)
        if worst > Next.DELIVERED or -lo != hi:  # trouble somewhere in the group, or its ranks got different rounds
            self.resync(f, Next(int(worst)) if worst > Next.DELIVERED else Next.RESYNC, named_at=ex.leases)
        else:
            carried = self._adopt(f, ex)
        self._landed(ex, outcome, waited, carried)
        return True

    def _agree_push(self, ex: Exchange) -> Next | None:
        """The push's outcome every rank of every group lands on; None when this step did not settle it.

        The pushing group's ranks report their push, every other rank NOBODY (0). Agreed on NOBODY, the pushing group
        is gone: the quorum's rank-0 group pushes from its own copy, and the landing is agreed again at the next step."""
        if ex.pusher:  # tests: the pushing group dying with the exchange in flight
            self.faults.hit("die-before-land", ex.round, ex.fragment)
        ex.pushed.wait()
        if isinstance(ex.outcome, grpc.RpcError) and reason_of(ex.outcome) == Reason.REPLACED:
            raise ex.outcome  # another process joined as this island: this one stops (islands/cli.py)
        agreed = self.replicas.agree_report(ex.status if ex.pusher and ex.status is not None else Next.NOBODY)
        if agreed is None:
            log.warning("%s group %d: landing of fragment %d round %d did not commit; redoing it", self.state.island_id,
                        self.ctx.spec.group, ex.fragment, ex.round)
            return None
        if agreed != Next.NOBODY:
            return Next(agreed)
        if self.replicas.leads():
            log.info("group %d rank %d: taking over the push of fragment %d round %d", self.ctx.spec.group,
                     self.ctx.world.rank, ex.fragment, ex.round)
            ex.pusher, self.takeovers = True, self.takeovers + 1
            self.evidence.event("takeover", round=ex.round, fragment=ex.fragment)
            ex.status = push(self.fragments[ex.fragment], ex, self.wire)
        return None

    def _collect(self, ex: Exchange) -> Next:
        """The push went through: this rank's ranges of the result, pulled now (a blocking exchange, a group that healed
        meanwhile) or by its thread. Returns what a failed pull calls for (DELIVERED: nothing failed)."""
        shard = self.fragments[ex.fragment]
        if self.ctx.feedback is not None:
            self.ctx.feedback.commit(list(shard.global_))
        if self.faults.due("perturb-before-pull", ex.round):
            next(t for t in (ex.staging or shard.global_).values() if t.numel()).view(-1)[0] += 0.5
        finish_pull(shard, ex, self.wire)
        if not isinstance(ex.outcome, BaseException):
            return Next.DELIVERED
        if not isinstance(ex.outcome, grpc.RpcError):
            raise ex.outcome
        if reason_of(ex.outcome) != Reason.REPLACED:  # that one is the line the island stops with
            log.warning("%s rank %d: pull of fragment %d round %d failed: %s", self.state.island_id, self.ctx.world.rank,
                        ex.fragment, ex.round, ex.outcome)
        trouble = next_step(ex.outcome)
        if trouble in (Next.DELIVERED, Next.FAIL):  # nothing a resync mends
            raise ex.outcome
        return trouble

    @staticmethod
    def _drop(ex: Exchange, outcome: Next) -> Next:
        """The push was refused: the exchange's pull is called off; the refusal is what the landing does."""
        ex.cancel.set()
        wait_exchange(ex)
        return outcome

    def _landed(self, ex: Exchange, outcome: Next, waited: float, carried: float) -> None:
        """A landing's accounting: the time blocked on it, its record, the evidence."""
        f = ex.fragment
        ex.landed_at = time.monotonic()
        blocked = ex.landed_at - (ex.started_at if not ex.background else waited)
        self.timing["wait_s"] += blocked
        self.timing["straggler_s"] += min(blocked, ex.held_s)
        self.ctx.exchanges.append(ex.record())
        if f == 0:
            self.state.rounds_done += 1
        self.evidence.event("exchange", round=ex.round, fragment=f, pusher=ex.pusher, outcome=int(outcome), carried=carried,
                            due=ex.due, pushed_step=ex.pushed_step, globals=digest(self.fragments[f].flat.values()) if self.evidence.enabled else "")

    def _adopt(self, f: int, ex: Exchange) -> float:
        """The round's result landed: mix it into theta_local (pure adoption when the island stops here).
        Returns the residual kept in the local shard (sum of magnitudes; 0 unless wire.feedback_in_model)."""
        s, shard, header = self.state, self.fragments[f], ex.outcome
        if ex.folded_into >= 0:  # the push was late: the coordinator folds it into a later round, discounted
            self.late_folds += 1
            log.info("%s: fragment %d round %d was folded late, into round %d; training for round %d", s.island_id, f,
                     ex.round, ex.folded_into, header.round)
        if ex.staging is not None:
            for name, t in shard.global_.items():
                t.copy_(ex.staging[name])
        s.rounds[f], s.checksums[f] = header.round, header.checksum
        s.finished = s.finished or header.run_finished
        self.schedule.align_step(f)  # a late fold may land us more than one round on
        if header.push_codec in self.wire.codecs and header.push_codec != (s.codecs[f] or self.wire.codec.name):
            # Compression per link: every rank and group hears the same advice; error feedback carries over as is.
            log.info("%s: fragment %d pushes with %s from round %d (was %s)", s.island_id, f, header.push_codec, header.round,
                     s.codecs[f] or self.wire.codec.name)
            s.codecs[f] = header.push_codec
        final = header.round >= s.stop_round or header.run_finished  # the island ends holding exactly theta_global
        return self.mode.adopt(ex, shard, final)

    # --- resync: the round went on without us, or our copy drifted ------------------------------------

    @torch.no_grad()
    def resync(self, f: int, why: Next, named_at: int | None = None) -> None:
        """Fragment f takes the coordinator's current round; REJOIN, RESET and RELEASE do their part first.
        named_at: for RELEASE, the island's leases_forgotten when the refused samples were named."""
        s, shard = self.state, self.fragments[f]
        log.warning("%s group %d: fragment %d resyncs after round %d (%s)", s.island_id, self.ctx.spec.group, f, s.rounds[f], why.name)
        self._mend(why, named_at)
        one = None if len(self.fragments) == 1 else f
        header, _ = self._fetch(shard.global_, shard, fragment=one)
        s.resyncs += 1
        if header.round < s.rounds[f] and s.leases_taken:
            # The coordinator restarted from an older checkpoint, which knows none of the leases we took since: the
            # rounds we train again take new ones rather than naming samples it would refuse (NOT_LEASED).
            s.forget_leases(s.leases_forgotten)
        if one is not None and header.round < s.rounds[f]:
            self._rewind()  # the coordinator restarted behind us (fragments share the step counter)
            return
        s.rounds[f], s.checksums[f] = header.round, header.checksum
        s.finished = s.finished or header.run_finished
        mix_(shard.local, shard.flat, 0.0)
        self.schedule.align_step(f)  # the coordinator may be more than one round on
        s.restart_fragment(f)
        self.mode.forget(f)

    def _mend(self, why: Next, named_at: int | None) -> None:
        """What a resync for REJOIN, RESET or RELEASE does first: join again, fresh training, new leases."""
        s, world = self.state, self.ctx.world
        if why is Next.REJOIN:
            joined = (self.ctx.client.join(self.ctx.cfg.digest(), self.wire.codec.name, s.island_id, self.ctx.spec.key,
                                           ranks=self.ctx.spec.groups * world.world_size) if world.is_leader else None)
            s.island_id = world.broadcast_object(joined.island_id if joined else None)
        if why is Next.RESET:  # our training diverged: a fresh inner optimizer and error feedback
            self.ctx.reset_training()
        if why is Next.RELEASE and s.forget_leases(s.leases_forgotten if named_at is None else named_at):
            log.warning("%s: the coordinator does not take the samples we leased; dropping them, taking new ones", s.island_id)

    @torch.no_grad()
    def _rewind(self) -> None:
        """The coordinator is behind this island (it restarted from a checkpoint of an earlier round): every fragment
        goes back to the coordinator's round and the island trains from that round's start, as a resumed island does
        (start()), so each round it replays holds all of its inner steps. Only the work since the coordinator's
        checkpoint is lost. With fragments, a per-fragment shift would not do: the fragments share one step counter."""
        s = self.state
        header = self._fetch_all(self.ctx.params.global_)
        s.rounds = [f.round for f in header.fragments] or [header.round]
        s.checksums = [f.checksum for f in header.fragments] or [header.checksum]
        s.finished = s.finished or header.run_finished
        s.step = self.ctx.layout.start_step(s.rounds, self.ctx.total_rounds)
        for f, shard in enumerate(self.fragments):
            s.restart_fragment(f)
            mix_(shard.local, shard.flat, 0.0)
            self.mode.forget(f)
        self.schedule.defer_starts()
        log.warning("%s: the coordinator went back to fragment rounds %s (it restarted): training again from inner step %d",
                    s.island_id, s.rounds, s.step)

    # --- finish: every rank holds theta_global; the quorum's rank-0 group leaves ------------------------

    def finish(self, last_try: bool = False) -> bool | None:
        """Agrees across the groups that every shard equals theta_global, then leaves.

        Returns whether the coordinator confirmed our parameters (for the other
        groups: whether every shard matched), None if this step did not commit.
        """
        s, params = self.state, self.ctx.params
        # Leaving early, or time-boxed fragments (each ends its last round at its own step; the steps after it moved the
        # model's copy of that fragment): end on the global parameters all the same.
        if s.stop_round < self.ctx.total_rounds and not s.finished or self.schedule.push_first:
            for shard in self.fragments:
                mix_(shard.local, shard.flat, 0.0)
        mine = all(torch.equal(params.local[n].cpu(), t.view(-1)) for n, t in params.global_.items())
        verified = self.replicas.agree_all(mine, last_try)
        if verified is None:
            return None
        self.final_checksum = ""
        if not (self.replicas.leads() and self.ctx.world.is_leader):
            return verified
        stats = {k: v for k, v in self.timing.items() if k in pb.LeaveRequest.DESCRIPTOR.fields_by_name}
        reply = self.ctx.client.leave(s.island_id, "", s.round, dict(stats, inner_steps=s.step),
                                      fragment_checksums=list(s.checksums) if verified else ["shards-differ"],
                                      untrained=s.untrained() if self.ctx.leased else [])
        self.final_checksum = reply.checksum if reply.checksum_matches else "differs"
        return reply.checksum_matches

    # --- healing: the exchanges in flight and the round's clock, for a restarted group ----------------

    def heal_state_dict(self) -> dict:
        return {"inflight": {f: ex.state_dict() for f, ex in self.inflight.items()}, "clock": self.schedule.state_dict()}

    def load_heal_state_dict(self, sd: dict) -> None:
        self.schedule.load_state_dict(sd["clock"])
        self.inflight.clear()  # the schedule reads the same dict
        self.inflight.update({int(f): Exchange(**saved, pusher=False, status=Next.NOBODY) for f, saved in sd["inflight"].items()})
        for ex in self.inflight.values():
            ex.pushed.set()  # it pulls at the landing; the push is its peers' (or a takeover's)
