"""The island's side of an outer round, read top to bottom: when a round ends, the exchange, the landing.

One object, `IslandRound`, owned by the island (islands/island.py), does it
for every island kind; its collaborators are passed in and named in its
__init__. The island's loop asks it whether a fragment's round is over, begins
the fragment's exchange, and lands it; the rest happens here:

- When a round ends (`RoundPace`): the run's fixed schedule (the default:
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
  half-written. The landing comes tau steps later.
- The landing (`land`), a resync (`resync`), a rewind (`_rewind`) and the
  finish (`finish`): every one runs on every rank of every replica group at
  the same step, so the agreements (within a group with torch.distributed,
  across the groups through torchft) line up. The outcome every rank agrees on
  is islands/outcome.py's `Next`, MAX-reduced.

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
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from diloco.wire.codec import Codec
from diloco.config import RunConfig
from diloco.wire.feedback import ErrorFeedback
from diloco.fragments import FragmentLayout
from diloco.wire.frames import Chunk, chunk_of, fp32_payload
from diloco.pace import lr_position, max_round_steps, paced
from diloco.streaming import EagerState, eager_gradient, mix_, swap_estimate_
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import FlatRange, Manifest, chunk_spans
from diloco.wire.refusal import Reason, reason_of
from islands.client import CoordinatorClient, MeanBuffer, RegeneratingChunks
from islands.evidence import Evidence, digest, fault_due, maybe_fault
from islands.outcome import Next, next_step, reason_name
from islands.replicas import Replicas, Solo
from islands.state import IslandState, ReplicaSpec
from islands.world import IslandWorld

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
class FragmentShard:
    """This rank's part of one fragment (or of the whole model): its ranges, and views of theta_local and theta_global there."""

    index: int
    manifest: Manifest  # the fragment's parameters, full shapes
    ranges: list[FlatRange]  # this rank's ranges of them
    whole: bool  # the rank holds all of it (a one-rank island): results come without ranges
    local: dict[str, torch.Tensor]  # flat views of the model's parameters (writes go to the model)
    global_: dict[str, torch.Tensor]  # theta_global: shaped like the parameters when whole, flat otherwise

    @property
    def wire_ranges(self) -> list[FlatRange] | None:
        return None if self.whole else self.ranges

    def numel(self) -> int:
        return sum(r.numel for r in self.ranges)

    def flat_global(self, name: str) -> torch.Tensor:
        return self.global_[name].view(-1)

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        """theta_global as flat views, shaped like the local views."""
        return {n: t.view(-1) for n, t in self.global_.items()}


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


def _label(shard: FragmentShard) -> str:
    return f"fragment {shard.index} "


# --- the island's side of the round -----------------------------------------------------------------------


class IslandRound:
    """The island's side of every fragment's rounds: when one ends, its exchange, its landing, a resync, the finish.

    Every method runs on every rank of every replica group at the same step.
    """

    def __init__(
        self, cfg: RunConfig, spec: ReplicaSpec, world: IslandWorld, client: CoordinatorClient, state: IslandState,
        layout: FragmentLayout, total_rounds: int, params: FragmentShard, fragments: list[FragmentShard], wire: Wire,
        down: Codec, feedback: ErrorFeedback | None, eager: list[EagerState] | None, replicas: Solo | Replicas,
        group_reduce: Callable[..., list[float]], reset_training: Callable[[], None], leased: bool, evidence: Evidence,
        timing: dict[str, float], records: list[dict],
    ):
        self.cfg, self.spec, self.world = cfg, spec, world
        self.client = client
        self.state = state  # the island's position: what it advances, a checkpoint writes and a healing group receives
        self.layout, self.total_rounds = layout, total_rounds  # the fragments' fixed schedule
        self.params = params  # this rank's part of the whole model: the initial fetch, a rewind, the finish
        self.fragments = fragments  # this rank's part of each fragment: its exchange, landing and resync
        self.wire, self.down = wire, down  # the uplink (push, pull), the downlink's codec (eager's mean)
        self.feedback, self.eager = feedback, eager  # error feedback; eager updates' memory per fragment
        self.replicas = replicas  # the replica groups: Solo until the island starts torchft's (use_replicas)
        self.group_reduce = group_reduce  # an all-reduce over the group's ranks
        self.reset_training = reset_training  # a fresh inner optimizer and error feedback (our training diverged)
        self.leased = leased  # the island trains on leased samples: it hands back those it did not train at leave
        self.evidence = evidence
        self.timing = timing  # the island's seconds by kind: a landing adds the time blocked on it
        self.records = records  # one record per landed exchange
        self.tau, self.alpha = cfg.streaming.overlap, cfg.streaming.alpha
        # When a round ends; a time box does not count the time blocked on a result.
        self.pace = RoundPace(cfg, spec.steps_per_round, blocked=lambda: timing["wait_s"])
        self.agreed_clock: tuple[int, list[float]] = (-1, [])  # (step, fragment clocks) every rank and group agreed on
        self.inflight: dict[int, Exchange] = {}
        # Fragments whose round starts later than where the island trains from (_defer_starts): step -> its start.
        self.deferred: dict[int, int] = {}
        self.late_folds = 0  # pushes the coordinator folded into a later round (rounds.late_rounds)
        self.takeovers = 0
        self.final_checksum = ""  # what the coordinator said of our parameters at leave

    def use_replicas(self, replicas: Replicas) -> None:
        """From now on the replica groups are torchft's, which the island started as it began to run."""
        self.replicas = replicas

    # --- start: fetch theta_global; a resumed island keeps the fragments it has right ----------------

    @torch.no_grad()
    def start(self, restored: bool) -> None:
        s = self.state
        into = self.params.global_ if not restored else {n: torch.empty_like(t) for n, t in self.params.global_.items()}
        header = self._fetch_all(into)
        rounds = [f.round for f in header.fragments] or [header.round]
        sums = [f.checksum for f in header.fragments] or [header.checksum]
        adopt = [not restored or (r, c) != (mine, own) for r, c, mine, own in zip(rounds, sums, s.rounds, s.checksums)]
        if restored and any(adopt):
            log.warning("%s: checkpoint is at fragment rounds %s, the coordinator at %s; resyncing %s",
                        s.island_id, s.rounds, rounds, [f for f, a in enumerate(adopt) if a])
        for f in (f for f, a in enumerate(adopt) if a):
            for name, t in self.fragments[f].global_.items():
                if restored:
                    t.copy_(into[name])
            s.rounds[f], s.checksums[f] = rounds[f], sums[f]
        if any(adopt):
            s.step = self.layout.start_step(s.rounds, self.total_rounds)
            for f in range(len(self.fragments)):
                s.restart_fragment(f)
        for f in (f for f, a in enumerate(adopt) if a):
            mix_(self.fragments[f].local, self.fragments[f].flat, 0.0)  # theta_local <- theta_global
        if any(adopt):
            self._defer_starts()
        s.finished = s.finished or header.run_finished

    def _defer_starts(self) -> None:
        """After the island moved to the earliest of its fragments' round starts (start_step): a fragment whose own
        round starts a whole round or more later begins it there, as its landing would have begun it, not now. That
        happens when a restarted coordinator's fragments are out of their schedule's order (one closed a round the
        other lost): counted from now, that fragment's round would claim more inner steps than a round holds, and be
        refused. The steps before its start train it for nothing; at its start its local values go back to the
        global ones (round_begins)."""
        s, h = self.state, self.cfg.inner.steps_per_round
        self.deferred = {}
        if self.pace.custom:
            return
        for f in range(len(self.fragments)):
            begin = self.layout.round_start(f, s.rounds[f], self.total_rounds)
            if s.rounds[f] < self.total_rounds and begin - s.step >= h:
                s.last_sync[f] = self.deferred[f] = begin

    def round_begins(self, f: int) -> None:
        """Fragment f's round takes its first inner step now: its time box starts, and a start put off by
        _defer_starts begins the round afresh from the global values, as a landing does."""
        self.pace.begin_round(f)
        if self.deferred.pop(f, None) is not None:
            mix_(self.fragments[f].local, self.fragments[f].flat, 0.0)
            self.state.restart_fragment(f)

    def _fetch_all(self, into: dict[str, torch.Tensor]) -> pb.ResultHeader:
        """Every fragment's global parameters (this rank's ranges), the same round on every rank of the group."""
        for _ in range(5):
            header = self.client.fetch(self.state.island_id, into, self.params.manifest, self.params.wire_ranges)
            lo, hi = self.group_reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                return header
            log.warning("ranks fetched different rounds (%d..%d); fetching again", -lo, hi)
        raise RuntimeError("the group's ranks could not fetch the same round of global parameters; is the coordinator restarting?")

    # --- pacing: whether a round is over, the lr's position, the clock every rank agrees on -------------

    def lr_step(self) -> int:
        """The inner lr schedule's position of this step: the run-wide step on the fixed schedule; with a pace of the
        island's own, its step within the round it trains for, placed on that round's positions (diloco/pace.py)."""
        s = self.state
        if not self.pace.custom:
            return s.step
        round_ = s.rounds[0] + (0 in self.inflight)  # during an overlapped exchange it trains for the next round
        return lr_position(round_ * self.cfg.inner.steps_per_round, s.step - s.last_sync[0], self.cfg)

    def round_over(self, f: int) -> bool:
        """Whether fragment f's round ends at this step: the run's schedule, or this island's own pace (every rank agrees)."""
        s = self.state
        if not self.pace.custom:
            return s.step >= self.layout.round_end(f, s.rounds[f], self.total_rounds)
        if self.pace.time_boxed and len(self.fragments) > 1 and f != self._turn():
            return False
        elapsed = self._clock()[f] if self.pace.time_boxed and s.step > s.last_sync[f] else 0.0
        return self.pace.due(s.step - s.last_sync[f], elapsed, f)

    def _turn(self) -> int:
        """The fragment whose sync comes next. Time-boxed, islands of different speeds must still push fragments in one
        order, the fixed schedule's: by round, and within a round from fragment P - 1 (the largest offset) down to 0.
        Otherwise island A could wait on fragment 0's round while owing fragment 1's, which B waits on while owing
        fragment 0's: a deadlock until the deadline (torchft's streaming saw the same fragment-order deadlock)."""
        s, p = self.state, len(self.fragments)
        pending = [f for f in range(p) if s.rounds[f] < s.stop_round]
        return min(pending, key=lambda f: (s.rounds[f] + (f in self.inflight), p - 1 - f), default=0)

    def _clock(self) -> list[float]:
        """The fragments' elapsed round times as every rank of every replica group sees them at this step.

        One rank: its own clock. One group of several ranks: the largest of their clocks, reduced once a step.
        Several groups: what the last committed step's gradient all-reduce carried (`clock_extra`), the same
        bits in every group, so all of them end a round at the same step."""
        s = self.state
        step, agreed = self.agreed_clock
        if step == s.step and (self.spec.groups > 1 or self.world.world_size > 1):
            return agreed
        values = [self.pace.elapsed(f) for f in range(len(self.fragments))]
        if self.spec.groups == 1 and self.world.world_size == 1:
            return values
        if self.spec.groups > 1:
            log.warning("group %d: no agreed round clock at step %d; counting the round from now", self.spec.group, s.step)
            values = [0.0] * len(values)
        elif self.world.world_size > 1:
            values = self.group_reduce(values, dist.ReduceOp.MAX)  # the ranks' clocks differ: stop together
        self.agreed_clock = (s.step, values)
        return values

    def clock_extra(self) -> list[float]:
        """This rank's fragment clocks, to ride along the replica groups' gradient all-reduce (time mode, several groups)."""
        if not (self.pace.time_boxed and self.spec.groups > 1):
            return []
        return [self.pace.elapsed(f) for f in range(len(self.fragments))]

    def agree_clock(self, averaged: list[float]) -> None:
        """After a committed step: the groups' mean clocks (rank by rank), the largest over the group's ranks, is the
        clock of the next boundary everywhere."""
        if averaged:
            if self.world.world_size > 1:
                averaged = self.group_reduce(averaged, dist.ReduceOp.MAX)
            self.agreed_clock = (self.state.step + 1, averaged)  # the step about to complete

    def _align_step(self, f: int) -> None:
        """After adopting a round more than one ahead (a resync, a late fold), plain DiLoCo's fixed schedule would make
        the island train several rounds' steps in one: move the step counter (and the round's start with it) to the
        round's start, so the round holds H steps and trains at its own lr. After adopting a round whose end it has
        already passed (its push for that round was not taken: leases the restarted coordinator does not know, a
        checksum that diverged), it trains the round again instead of pushing an empty contribution to it."""
        s = self.state
        if self.pace.custom or len(self.fragments) > 1:
            return
        start = self.layout.round_start(f, s.rounds[f], self.total_rounds)
        redo = s.rounds[f] < s.stop_round and s.step >= self.layout.round_end(f, s.rounds[f], self.total_rounds) > start
        shift = start - s.step if redo else max(0, start - s.step)
        s.step += shift
        s.last_sync[f] += shift

    # --- a fragment's sync: the push now, the landing tau inner steps later ---------------------

    @torch.no_grad()
    def begin(self, f: int) -> None:
        """Fragment f's round ended here: each rank takes its shard of theta_global - theta_local and starts the exchange."""
        s, shard = self.state, self.fragments[f]
        c, h = s.step, self.cfg.inner.steps_per_round
        last = s.rounds[f] >= self.total_rounds - 1 if self.pace.custom else c >= self.total_rounds * h
        background = self.tau > 0 and not last
        steps = c - s.last_sync[f]
        if steps <= 0:
            log.warning("%s: fragment %d is due with no inner step trained for it; pushing it with no weight", s.island_id, f)
        loss_sum, n = self.group_reduce([s.loss[f][0], s.loss[f][1]])
        ex = Exchange(
            f, s.rounds[f], c, c + self.tau if background else c, tokens=s.tokens[f],
            inner_steps=max(steps, 1), train_loss=loss_sum / n if n else 0.0, checksum=s.checksums[f],
            pusher=self.replicas.participating_rank() == 0, samples=s.positions(s.data_marks[f], s.data_cursor),
            first_step=s.rounds[f] * h if self.pace.custom else -1,  # where its lr positions start (diloco/pace.py)
            codec=s.codecs[f],  # compression per link: as last advised, fixed for this push
            leases=s.leases_forgotten,
        )
        if background:
            ex.pg = {r.name: shard.flat_global(r.name) - shard.local[r.name].to("cpu", torch.float32) for r in shard.ranges}
            ex.staging = {n_: g.clone() for n_, g in shard.global_.items()}
        eager = self.eager[f] if self.eager is not None else None
        if eager is not None and background:
            ex.mean = MeanBuffer({n_: torch.zeros_like(t) for n_, t in ex.pg.items()}, shard.manifest, self.down, shard.wire_ranges)
            if eager.prev_mean is not None:
                ex.estimate = eager.replica.step(shard.flat, eager_gradient(eager.prev_mean, eager.prev_own, ex.pg, eager.share))
                mix_(shard.local, ex.estimate, self.alpha)
        log.debug("%s: fragment %d round %d pushes %d tokens of %d inner steps", s.island_id, f, ex.round, ex.tokens, ex.inner_steps)
        s.restart_fragment(f)
        self.pace.synced(f)  # its next time box is a whole round_s
        self.inflight[f] = ex
        if ex.pusher:  # tests: a pusher dying mid-push, or pushing late
            maybe_fault("die-before-push", self.spec.group, self.world.rank, ex.round)
            maybe_fault("hold-before-push", self.spec.group, self.world.rank, ex.round)
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
        """Lands fragment f's exchange; False when this step did not settle it (redo at the next step)."""
        ex, shard, s = self.inflight[f], self.fragments[f], self.state
        waited = time.monotonic()
        if ex.pusher:  # tests: the pushing group dying with the exchange in flight
            maybe_fault("die-before-land", self.spec.group, self.world.rank, ex.round, f)
        ex.pushed.wait()
        if isinstance(ex.outcome, grpc.RpcError) and reason_of(ex.outcome) == Reason.REPLACED:
            raise ex.outcome  # another process joined as this island: this one stops (islands/cli.py)
        # The pushing group's ranks report their push, every other rank NOBODY (0): the worst report within the
        # group, summed across the groups (one group pushes), is the outcome every rank of every group lands on.
        (status,) = self.group_reduce([ex.status if ex.pusher and ex.status is not None else Next.NOBODY], dist.ReduceOp.MAX)
        flag = torch.tensor([status], dtype=torch.float32, device=self.world.device)
        self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
        if not self.replicas.commit():
            log.warning("%s group %d: landing of fragment %d round %d did not commit; redoing it", s.island_id, self.spec.group, f, ex.round)
            return False
        outcome = Next(int(flag.item()))
        if outcome is Next.NOBODY:
            # The pushing group is gone: the quorum's rank-0 group pushes from its own copy.
            if self.replicas.participating_rank() == 0:
                log.info("group %d rank %d: taking over the push of fragment %d round %d", self.spec.group, self.world.rank, f, ex.round)
                ex.pusher, self.takeovers = True, self.takeovers + 1
                self.evidence.event("takeover", round=ex.round, fragment=f)
                ex.status = push(shard, ex, self.wire)
            return False
        trouble = outcome  # DELIVERED: none (yet)
        if outcome is Next.DELIVERED:
            if self.feedback is not None:
                self.feedback.commit(list(shard.global_))
            if fault_due("perturb-before-pull", self.spec.group, self.world.rank, ex.round):
                next(t for t in (ex.staging or shard.global_).values() if t.numel()).view(-1)[0] += 0.5
            if ex.thread is None and not isinstance(ex.outcome, (pb.ResultHeader, BaseException)):
                self._pull_now(shard, ex)  # blocking exchanges, and a group that healed meanwhile
            wait_exchange(ex)
            if isinstance(ex.outcome, grpc.RpcError):
                if reason_of(ex.outcome) != Reason.REPLACED:  # that one is the line the island stops with
                    log.warning("%s rank %d: pull of fragment %d round %d failed: %s", s.island_id, self.world.rank, f, ex.round,
                                ex.outcome)
                trouble = next_step(ex.outcome)
                if trouble in (Next.DELIVERED, Next.FAIL):  # nothing a resync mends
                    raise ex.outcome
            elif isinstance(ex.outcome, BaseException):
                raise ex.outcome
        else:
            ex.cancel.set()
            wait_exchange(ex)
        got = ex.outcome.round if isinstance(ex.outcome, pb.ResultHeader) else -1
        worst, lo, hi = self.group_reduce([trouble, -got, got], dist.ReduceOp.MAX)
        trouble = Next(int(worst))
        del self.inflight[f]
        carried = 0.0  # sum |residual| kept in the local shard (wire.feedback_in_model)
        if trouble > Next.DELIVERED or -lo != hi:
            self.resync(f, trouble if trouble > Next.DELIVERED else Next.RESYNC, named_at=ex.leases)
        else:
            if ex.folded_into >= 0:  # the push was late: the coordinator folds it into a later round, discounted
                self.late_folds += 1
                log.info("%s: fragment %d round %d was folded late, into round %d; training for round %d", s.island_id, f,
                         ex.round, ex.folded_into, got)
            carried = self._adopt(f, ex)
        ex.landed_at = time.monotonic()
        blocked = ex.landed_at - (ex.started_at if not ex.background else waited)
        self.timing["wait_s"] += blocked
        self.timing["straggler_s"] += min(blocked, ex.held_s)
        self.records.append(ex.record())
        if f == 0:
            s.rounds_done += 1
        self.evidence.event("exchange", round=ex.round, fragment=f, pusher=ex.pusher, outcome=int(outcome), carried=carried,
                            due=ex.due, pushed_step=ex.pushed_step, globals=digest(self.fragments[f].flat.values()) if self.evidence.enabled else "")
        return True

    def _pull_now(self, shard: FragmentShard, ex: Exchange) -> None:
        try:
            ex.outcome = pull(shard, ex, self.wire)
        except grpc.RpcError as e:
            ex.outcome = e
        ex.finished_at = time.monotonic()

    def _adopt(self, f: int, ex: Exchange) -> float:
        """The round's result landed: mix it into theta_local (pure adoption when the island stops here).
        Returns the residual kept in the local shard (sum of magnitudes; 0 unless wire.feedback_in_model)."""
        s, shard, header = self.state, self.fragments[f], ex.outcome
        if ex.staging is not None:
            for name, t in shard.global_.items():
                t.copy_(ex.staging[name])
        s.rounds[f], s.checksums[f] = header.round, header.checksum
        s.finished = s.finished or header.run_finished
        self._align_step(f)  # a late fold may land us more than one round on
        if header.push_codec in self.wire.codecs and header.push_codec != (s.codecs[f] or self.wire.codec.name):
            # Compression per link: every rank and group hears the same advice; error feedback carries over as is.
            log.info("%s: fragment %d pushes with %s from round %d (was %s)", s.island_id, f, header.push_codec, header.round,
                     s.codecs[f] or self.wire.codec.name)
            s.codecs[f] = header.push_codec
        final = header.round >= s.stop_round or header.run_finished  # the island ends holding exactly theta_global
        eager = self.eager[f] if self.eager is not None else None
        carried = 0.0
        if final:
            mix_(shard.local, shard.flat, 0.0)
        elif ex.estimate is not None:
            swap_estimate_(shard.local, shard.flat, ex.estimate, self.alpha)
        else:
            mix_(shard.local, shard.flat, self.alpha)
            if self.feedback is not None and self.feedback.in_model:
                # What the codec did not send stays in this island's parameters.
                self.feedback.keep_residual_(shard.local, 1.0 - self.alpha)
                carried = sum(self.feedback.buffers[n].abs().sum().item() for n in shard.local)
        if eager is not None:
            if ex.mean is not None and ex.mean.complete and header.tokens > 0 and header.round == ex.round + 1:
                eager.replica.advance(ex.mean.tensors)
                eager.prev_mean, eager.prev_own, eager.share = ex.mean.tensors, ex.pg, min(1.0, ex.tokens / header.tokens)
            else:
                eager.forget()
        return carried

    # --- resync: the round went on without us, or our copy drifted ------------------------------------

    @torch.no_grad()
    def resync(self, f: int, why: Next, named_at: int | None = None) -> None:
        """Fragment f takes the coordinator's current round; REJOIN, RESET and RELEASE do their part first.
        named_at: for RELEASE, the island's leases_forgotten when the refused samples were named."""
        s, shard = self.state, self.fragments[f]
        log.warning("%s group %d: fragment %d resyncs after round %d (%s)", s.island_id, self.spec.group, f, s.rounds[f], why.name)
        if why is Next.REJOIN:
            joined = (self.client.join(self.cfg.digest(), self.wire.codec.name, s.island_id, self.spec.key,
                                       ranks=self.spec.groups * self.world.world_size) if self.world.is_leader else None)
            s.island_id = self.world.broadcast_object(joined.island_id if joined else None)
        if why is Next.RESET:  # our training diverged: a fresh inner optimizer and error feedback
            self.reset_training()
        if why is Next.RELEASE:
            if s.forget_leases(s.leases_forgotten if named_at is None else named_at):
                log.warning("%s: the coordinator does not take the samples we leased; dropping them, taking new ones",
                            s.island_id)
        one = None if len(self.fragments) == 1 else f
        for _ in range(5):
            header = self.client.fetch(s.island_id, shard.global_, shard.manifest, shard.wire_ranges, fragment=one)
            lo, hi = self.group_reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                break
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
        self._align_step(f)  # the coordinator may be more than one round on
        s.restart_fragment(f)
        if self.eager is not None:
            self.eager[f].forget()

    @torch.no_grad()
    def _rewind(self) -> None:
        """The coordinator is behind this island (it restarted from a checkpoint of an earlier round): every fragment
        goes back to the coordinator's round and the island trains from that round's start, as a resumed island does
        (start()), so each round it replays holds all of its inner steps. Only the work since the coordinator's
        checkpoint is lost. With fragments, a per-fragment shift would not do: the fragments share one step counter."""
        s = self.state
        header = self._fetch_all(self.params.global_)
        s.rounds = [f.round for f in header.fragments] or [header.round]
        s.checksums = [f.checksum for f in header.fragments] or [header.checksum]
        s.finished = s.finished or header.run_finished
        s.step = self.layout.start_step(s.rounds, self.total_rounds)
        for f, shard in enumerate(self.fragments):
            s.restart_fragment(f)
            mix_(shard.local, shard.flat, 0.0)
            if self.eager is not None:
                self.eager[f].forget()
        self._defer_starts()
        log.warning("%s: the coordinator went back to fragment rounds %s (it restarted): training again from inner step %d",
                    s.island_id, s.rounds, s.step)

    # --- finish: every rank holds theta_global; the quorum's rank-0 group leaves ------------------------

    def finish(self, last_try: bool = False) -> bool | None:
        """Agrees across the groups that every shard equals theta_global, then leaves.

        Returns whether the coordinator confirmed our parameters (for the other
        groups: whether every shard matched), None if this step did not commit.
        """
        s = self.state
        # Leaving early, or time-boxed fragments (each ends its last round at its own step; the steps after it moved the
        # model's copy of that fragment): end on the global parameters all the same.
        if s.stop_round < self.total_rounds and not s.finished or self.pace.time_boxed and len(self.fragments) > 1:
            for shard in self.fragments:
                mix_(shard.local, shard.flat, 0.0)
        mine = all(torch.equal(self.params.local[n].cpu(), t.view(-1)) for n, t in self.params.global_.items())
        (bad,) = self.group_reduce([float(not mine)])
        flag = torch.tensor([float(bad == 0), 1.0], dtype=torch.float32, device=self.world.device)
        self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
        if not self.replicas.commit() and not last_try:
            return None
        verified = flag[0].item() == flag[1].item()
        self.final_checksum = ""
        if self.replicas.participating_rank() == 0 and self.world.is_leader:
            stats = {k: v for k, v in self.timing.items() if k in pb.LeaveRequest.DESCRIPTOR.fields_by_name}
            reply = self.client.leave(s.island_id, "", s.round, dict(stats, inner_steps=s.step),
                                      fragment_checksums=list(s.checksums) if verified else ["shards-differ"],
                                      untrained=s.untrained() if self.leased else [])
            self.final_checksum = reply.checksum if reply.checksum_matches else "differs"
            return reply.checksum_matches
        return verified

    # --- healing: the exchanges in flight and the round's clock, for a restarted group ----------------

    def heal_state_dict(self) -> dict:
        return {
            "inflight": {f: ex.state_dict() for f, ex in self.inflight.items()},
            "clock": {"agreed": list(self.agreed_clock), "pace": self.pace.state_dict()},  # time-boxed rounds
        }

    def load_heal_state_dict(self, sd: dict) -> None:
        step, agreed = sd["clock"]["agreed"]
        self.agreed_clock = (int(step), list(agreed))
        self.pace.load_state_dict(sd["clock"]["pace"])
        self.inflight = {int(f): Exchange(**saved, pusher=False, status=Next.NOBODY) for f, saved in sd["inflight"].items()}
        for ex in self.inflight.values():
            ex.pushed.set()  # it pulls at the landing; the push is its peers' (or a takeover's)
