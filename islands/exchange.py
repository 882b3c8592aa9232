"""One fragment's exchange with the coordinator, as one rank of any island sees it.

At fragment f's sync step every rank takes its part of the fragment's
pseudo-gradient (theta_global_f - theta_local_f, fp32, its own shard). The
ranks of the pushing replica group (every rank, with one group) stream their
shards, addressed by name and flat offset; the coordinator counts the island's
contribution once every element arrived exactly once. Ranks of other groups
encode the same chunks without sending them, so their error feedback moves
exactly like the pusher's. Then every rank pulls the round's result for its
ranges.

Blocking (tau = 0): the push part runs inline and the pull waits for the
landing, after the groups agreed the push went through. Overlapped (tau > 0):
the pseudo-gradient is snapshotted, and push and pull run on a thread of their
own while inner steps go on; the pull writes into a staging copy, so what a
checkpoint or a healing peer reads of theta_global is never half-written. The
training thread lands the exchange tau steps later (islands/island.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from diloco.codec import Codec
from diloco.feedback import ErrorFeedback
from diloco.frames import Chunk, chunk_of, fp32_payload
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import FlatRange, Manifest, chunk_spans
from islands.client import CoordinatorClient, MeanBuffer, RegeneratingChunks
from islands.outcome import Next, next_step, reason_name

log = logging.getLogger(__name__)

# Push outcomes, agreed across ranks and groups: the worst (largest) wins.
NOBODY, PUSHED, LOST, REJOIN, RESET, RELEASE = 0, 1, 2, 3, 4, 5
_STATUS = {Next.DELIVERED: PUSHED, Next.RESYNC: LOST, Next.PUSH_AGAIN: LOST, Next.FINISHED: LOST,
           Next.REJOIN: REJOIN, Next.RESET: RESET, Next.RELEASE: RELEASE}
_PULL_WAIT_S = 10.0  # a pull waits at most this long per call, then looks whether it was cancelled


@dataclass
class FragmentShard:
    """This rank's part of one fragment: its ranges, and views of theta_local and theta_global there."""

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
    pg: dict[str, torch.Tensor] | None = None  # snapshot of the pseudo-gradient shard (overlapped exchanges)
    staging: dict[str, torch.Tensor] | None = None  # where an overlapped pull writes theta_global_f
    estimate: dict[str, torch.Tensor] | None = None  # eager: the provisional global trained from meanwhile
    mean: MeanBuffer | None = None  # eager: where the round's mean pseudo-gradient arrives
    status: int | None = None  # push outcome (NOBODY on ranks that do not push)
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
                "codec")
        return {k: getattr(self, k) for k in keys} | {"pg": self.pg}


def pg_chunks(shard: FragmentShard, ex: Exchange, wire: Wire, start: int = 0) -> Iterator[Chunk]:
    """The pseudo-gradient of this rank's shard as chunks, one chunk at a time; a pure function of the
    exchange (error feedback writes only its pending residual), so every resend is the same bytes."""
    codec = wire.codec_for(ex)
    i = 0
    for r in shard.ranges:
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


def push(shard: FragmentShard, ex: Exchange, wire: Wire) -> int:
    """Streams this rank's shard; returns PUSHED or what the refusal calls for (LOST, REJOIN, RESET)."""
    if shard.numel() == 0:
        return PUSHED
    header = pb.PushHeader(
        island_id=wire.island_id(), round=ex.round, tokens=ex.tokens, train_loss=ex.train_loss, codec=wire.codec_for(ex).name,
        inner_steps=ex.inner_steps, global_checksum=ex.checksum, fragment=ex.fragment,
        samples=[pb.SampleRange(start=a, stop=b) for a, b in ex.samples],
        first_step=ex.first_step if ex.first_step >= 0 else max(0, ex.pushed_step - ex.inner_steps),
    )
    try:
        response = wire.client.push(header, RegeneratingChunks(lambda start: pg_chunks(shard, ex, wire, start)))
        if response.late:  # delivered, for a later round: the pull brings the current global parameters
            ex.folded_into = response.folded_into
        return PUSHED
    except grpc.RpcError as e:
        status = _STATUS.get(next_step(e))
        if status != PUSHED:  # every refusal is in the island's own log, with its reason
            log.log(logging.ERROR if status is None else logging.WARNING, "%s: push of %sround %d refused: %s: %s",
                    header.island_id, _label(shard), ex.round, reason_name(e), e.details())
        if status is None:
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
            if push(shard, ex, wire) != PUSHED:
                raise


def start(shard: FragmentShard, ex: Exchange, wire: Wire) -> None:
    """Runs the push part (pushers push, the others encode only); an overlapped exchange also pulls, on its thread."""

    def work() -> None:
        try:
            with torch.no_grad():
                if ex.pusher:
                    ex.status = push(shard, ex, wire)
                else:
                    encode_only(shard, ex, wire)
                    ex.status = NOBODY
                ex.pushed.set()
                if ex.background and ex.status in (PUSHED, NOBODY):
                    ex.outcome = pull(shard, ex, wire)
        except BaseException as e:  # handed to the training thread at the landing
            ex.outcome = e
            if ex.status is None:
                ex.status = LOST
        ex.pushed.set()
        ex.finished_at = time.monotonic()

    ex.started_at = time.monotonic()
    if ex.background:
        ex.thread = threading.Thread(target=work, name=f"exchange-f{ex.fragment}-r{ex.round}", daemon=True)
        ex.thread.start()
    else:
        work()


def wait(ex: Exchange) -> None:
    if ex.thread is not None:
        ex.thread.join()
        ex.thread = None


def _label(shard: FragmentShard) -> str:
    return f"fragment {shard.index} "
