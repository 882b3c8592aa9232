"""What islands hold: the published global parameters and the last round's update.

With a lossless downlink the published parameters are the outer optimizer's own.
With a lossy one the coordinator sends each round's update compressed and adds
exactly what it sent to its published copy, so the published copy and every
island's stay bit-identical; the outer parameters keep full precision and the
gap between the two (theta_outer - theta_published) is the downlink's error
feedback, carried into the next round's update. The published copy is file-backed
(coordinator/filebacked.py): every use hands back the pages it touched, so it is
not a fourth model in the coordinator's resident memory.
"""

from __future__ import annotations

import bisect
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field

import torch

from coordinator.filebacked import FileBackedParams
from diloco.wire.codec import Codec, get_codec
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.wire.refusal import Reason, Refused
from diloco.params import checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.frames import Chunk, chunk_of, fp32_payload, frame_chunk, parse_chunk_message
from diloco.wire.messages import FlatRange, chunk_spans, make_chunk, payload_digest

log = logging.getLogger(__name__)


class DeltaStream:
    """A round's lossy update while it is made, chunk by chunk: a pull sends the chunks made so far and waits for the
    rest, then the trailer (the checksum and run_finished its header could not carry yet)."""

    WAIT_S = 600.0  # a publication that makes no chunk for this long has failed

    def __init__(self, round_: int, base_checksum: str, islands: int, tokens: int):
        self.round, self.base_checksum, self.islands, self.tokens = round_, base_checksum, islands, tokens
        self.chunks: list[pb.TensorChunk] = []
        self.checksum, self.run_finished = "", False
        self.done = self.failed = False
        self._cond = threading.Condition()

    def extend(self, chunks: list[pb.TensorChunk]) -> None:
        with self._cond:
            self.chunks.extend(chunks)
            self._cond.notify_all()

    def finish(self, checksum_: str, run_finished: bool) -> None:
        with self._cond:
            self.checksum, self.run_finished, self.done = checksum_, run_finished, True
            self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self.failed = self.done = True
            self._cond.notify_all()

    def __iter__(self) -> Iterator[pb.TensorChunk]:
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: i < len(self.chunks) or self.done, self.WAIT_S)
                batch = self.chunks[i:]
                if self.failed or not (batch or self.done):  # the island never applies a delta cut short
                    raise Refused(Reason.STILL_OPEN, f"round {self.round}'s update was not published; pull again")
            if not batch:
                return
            yield from batch
            i += len(batch)

    def trailer(self) -> pb.ResultTrailer:
        """Once every chunk was sent (the iteration ended)."""
        return pb.ResultTrailer(checksum=self.checksum, run_finished=self.run_finished)


@dataclass(frozen=True, slots=True)
class ValueMessage:
    """One serialized ResultMessage(chunk=...) of published fp32 values: elements [offset, offset + numel) of name."""

    name: str
    offset: int
    numel: int
    data: bytes

    @property
    def end(self) -> int:
        return self.offset + self.numel


def _overlapping(spans: list[tuple[str, int, int]], ranges: list[FlatRange] | None) -> list[int]:
    """The indices of the spans that overlap any of the ranges (all of them without ranges)."""
    if ranges is None:
        return list(range(len(spans)))
    by_name: dict[str, list[tuple[int, int]]] = {}
    for r in ranges:
        by_name.setdefault(r.name, []).append((r.offset, r.end))
    return [k for k, (name, lo, hi) in enumerate(spans) if any(a < hi and lo < b for a, b in by_name.get(name, ()))]


class PublishedValues:
    """One version of the published parameters as fp32 value messages, never changed once made.

    Memory: no copy of the values. While the parameters stay, each reader's messages are framed from them as it
    reads (the chunks' digests are made once and shared). Before the parameters change (finish: the outer step is
    coming), a version someone still reads is written once, whole, to an unlinked file beside the spool, and its
    readers go on from there at their own pace: the step never waits for a reader, and what a slow or stalled
    reader holds is disk and page cache, not the coordinator's resident memory. A version nobody reads is just
    closed.

    A reader registers (open) under the parameters' read lock, holding it only that long, and streams without it.
    Framing and finish take the version's own lock, so no message is framed from parameters the step has begun to
    change. What stalled readers can hold is bounded by Publication (see _supersede).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], chunk_bytes: int, spill_dir: str | None = None,
                 release: Callable[[str, int, int], None] | None = None):
        """release(name, lo, hi): what hands back the pages a message was framed from (a file-backed copy's)."""
        fp32 = get_codec("fp32")
        self._release = release
        self._flat = {name: t.detach().reshape(-1) for name, t in params.items()}
        self._names = {name: name.encode() for name in params}
        self.spans = [(name, lo, hi) for name, t in self._flat.items() for lo, hi in chunk_spans(t.numel(), fp32, chunk_bytes)]
        self._digests: list[int | None] = [None] * len(self.spans)
        self._spill_dir = spill_dir
        self._file = None  # the version written out (finish, while read): its messages at _index[k] = (start, size)
        self._index: list[tuple[int, int]] = []
        self.complete = False  # finish() was called: made from the parameters before they changed
        self._dropped: Exception | None = None
        self._frame_lock = threading.Lock()
        self._cuts: dict[int, Callable[[], None]] = {}  # reader -> what ends its call
        self._lock = threading.Lock()
        self._opened = 0

    def __iter__(self) -> Iterator[tuple[bytes, int]]:
        """The messages with their sizes."""
        return ((m.data, len(m.data)) for m in self.messages())

    def messages(self, ranges: list[FlatRange] | None = None) -> Iterator[ValueMessage]:
        """The messages in order; with ranges, only those that hold some of their elements."""
        for k in _overlapping(self.spans, ranges):
            name, lo, hi = self.spans[k]
            yield ValueMessage(name, lo, hi - lo, self._message(k))

    def _message(self, k: int) -> bytes:
        with self._frame_lock:
            if self._dropped is not None:
                raise self._dropped
            if self._file is not None:
                start, size = self._index[k]
                return os.pread(self._file.fileno(), size, start)
            if self.complete:  # finished unread: the parameters may have changed since (Publication opens a new one)
                raise Refused(Reason.ROUND_CLOSED, "the parameters changed while you read them; fetch again")
            return self._frame(k)

    def _frame(self, k: int) -> bytes:
        """Message k framed from the parameters (the caller holds the frame lock)."""
        name, lo, hi = self.spans[k]
        payload = fp32_payload(self._flat[name][lo:hi])
        if self._release is not None:
            self._release(name, lo, hi)
        if self._digests[k] is None:
            self._digests[k] = payload_digest(payload)
        return frame_chunk(2, Chunk(name, lo, hi - lo, payload, self._digests[k]), self._names[name])

    @property
    def readers(self) -> int:
        with self._lock:
            return len(self._cuts)

    def open(self, cut: Callable[[], None] = lambda: None) -> Callable[[], None]:
        """Counts a reader until the returned callable is called; cut ends its call should the version be dropped."""
        with self._lock:
            self._opened += 1
            key = self._opened
            self._cuts[key] = cut

        def done() -> None:
            with self._lock:
                self._cuts.pop(key, None)

        return done

    def finish(self) -> None:
        """The parameters are about to change: a version someone reads is written out whole now. When it cannot be
        (the disk full or gone), its readers are cut off as a dropped version's are: they fetch again, and the
        outer step goes on."""
        with self._frame_lock:
            if self.complete or self._dropped is not None:
                return
            failed: OSError | None = None
            if self.readers:
                try:
                    self._file = self._spill()
                except OSError as e:
                    failed = e
            self.complete = True
        if failed is not None:
            log.warning("could not keep the values slow readers read past the step (%s); they fetch again", failed)
            self.drop("the coordinator could not keep the values you were reading past the step; fetch again")

    def _spill(self):
        """Every message written to an unlinked file, its place in _index (the caller holds the frame lock)."""
        spill = tempfile.TemporaryFile(prefix="values-", dir=self._spill_dir)  # noqa: SIM115 - drop() closes it
        try:
            for k in range(len(self.spans)):
                data = self._frame(k)
                self._index.append((spill.tell(), len(data)))
                spill.write(data)
            spill.flush()
        except BaseException:
            spill.close()
            self._index = []
            raise
        return spill

    def held_bytes(self) -> int:
        """The bytes this version holds in memory (coordinator/memory.py): its chunks' digests."""
        return 8 * sum(d is not None for d in self._digests)

    def spilled_bytes(self) -> int:
        """The bytes it holds on disk (a version read across a step)."""
        return self._index[-1][0] + self._index[-1][1] if self._file is not None and self._index else 0

    def drop(self, why: str) -> None:
        """Frees the version: a reader gets ROUND_CLOSED at its next message, and its call is ended (one stalled in a
        send, its client reading nothing, would otherwise hold a server thread for as long as it likes)."""
        with self._frame_lock:
            self._dropped = Refused(Reason.ROUND_CLOSED, why)
            if self._file is not None:
                self._file.close()
            self._file, self._index = None, []
        with self._lock:
            cuts, self._cuts = list(self._cuts.values()), {}
        for cut in cuts:
            cut()


def range_messages(messages: Iterable[ValueMessage], ranges: list[FlatRange]) -> Iterator[bytes]:
    """The elements of the ranges in value messages: a message inside a range as it is, else its overlap with each
    range framed anew (fp32, addressed into the whole parameter). The ranges of a
    parameter must not overlap (the service refuses requests whose ranges do)."""
    by_name: dict[str, list[FlatRange]] = {}
    for r in ranges:
        by_name.setdefault(r.name, []).append(r)
    ends: dict[str, list[int]] = {}
    for name, rs in by_name.items():
        rs.sort(key=lambda r: r.offset)
        ends[name] = [r.end for r in rs]
    for m in messages:
        rs = by_name.get(m.name)
        if not rs:
            continue
        for r in rs[bisect.bisect_right(ends[m.name], m.offset):]:  # the first range that ends after m starts, on
            if r.offset >= m.end:
                break
            lo, hi = max(m.offset, r.offset), min(m.end, r.end)
            if lo >= hi:
                continue
            if (lo, hi) == (m.offset, m.end):
                yield m.data
                continue
            payload = parse_chunk_message(m.data, (2,)).payload  # fp32: 4 bytes an element
            yield frame_chunk(2, chunk_of(m.name, lo, hi - lo, payload[4 * (lo - m.offset) : 4 * (hi - m.offset)]))


@dataclass
class Reading:
    """What one read of the published parameters sends: taken under the parameters' read lock, held only that long,
    and sent without it, at the client's pace. done() once sent (or given up)."""

    header: pb.ResultHeader
    delta: Iterable[pb.TensorChunk] | None = None  # the update's chunks; None: the values
    values: list[PublishedValues] = field(default_factory=list)  # the value messages, a version per fragment read
    mean: list[pb.TensorChunk] = field(default_factory=list)  # the round's mean pseudo-gradient (eager updates)
    stream: DeltaStream | None = None  # an update streamed as it is made: its trailer completes the header
    releases: list[Callable[[], None]] = field(default_factory=list)

    def add_values(self, publication: Publication, cancel: Callable[[], None]) -> None:
        """Takes the publication's current version of the values (caller holds the read lock) and its release."""
        values, release = publication.open_values(cancel)
        self.values.append(values)
        self.releases.append(release)

    def value_messages(self, ranges: list[FlatRange] | None) -> Iterator[bytes]:
        messages = (m for v in self.values for m in v.messages(ranges))
        return (m.data for m in messages) if ranges is None else range_messages(messages, ranges)

    def done(self) -> None:
        for release in self.releases:
            release()
        self.releases.clear()


class Publication:
    def __init__(self, outer_params: Mapping[str, torch.Tensor], codec: Codec, chunk_bytes: int, pool: Executor | None = None,
                 spill_dir: str | None = None):
        self.outer_params = outer_params
        self.spill_dir = spill_dir  # where a version of the values read across a step is written (PublishedValues)
        self.pool = pool  # threads a lossy publication makes its chunks on (None: the caller's)
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.lossless = codec.name == "fp32"
        # A lossy downlink's published copy is file-backed: each use below hands its pages back (release).
        self.file = None if self.lossless else FileBackedParams(outer_params, spill_dir)
        if self.file is not None:
            log.info("the published parameters (%s downlink, %.1f MiB) are kept in a file in %s, not in memory",
                     codec.name, self.file.nbytes / 2**20, spill_dir or tempfile.gettempdir())
        self.params = dict(outer_params) if self.file is None else self.file.tensors
        self.checksum = self._checksum()
        # The last round's update: it takes params with delta_base to params with checksum.
        self.delta_chunks: list[pb.TensorChunk] = []
        self.delta_base = ""
        # The published values as messages (PublishedValues): this round's, made as they are read; and the version
        # before it while someone still reads it.
        self._values: PublishedValues | None = None
        self._superseded: PublishedValues | None = None
        self._closing = False  # release_values was called: the parameters change at the coming step
        self._values_lock = threading.Lock()

    def held_values(self) -> dict[str, int]:
        """What the value versions hold (coordinator/memory.py): in memory, this round's and the one before it while
        someone still reads it; on disk, a version read across a step."""
        with self._values_lock:
            versions = [v for v in (self._values, self._superseded) if v is not None]
        return {"published_values": sum(v.held_bytes() for v in versions),
                "values_on_disk": sum(v.spilled_bytes() for v in versions)}

    def value_messages(self) -> PublishedValues:
        """This round's version of the published parameters as fp32 value messages (ResultMessage): framed from the
        parameters as each pull reads them, so no copy of the model is held and no island waits for the whole model
        to be encoded before its first byte. A reader takes them with open_values.
        """
        with self._values_lock:
            if self._values is None:
                self._values = self._new_values()
            return self._values

    def _new_values(self) -> PublishedValues:
        """A version of the values framed from the parameters (the caller holds the values lock)."""
        return PublishedValues(self.params, self.chunk_bytes, self.spill_dir, None if self.file is None else self.release)

    def open_values(self, cut: Callable[[], None] = lambda: None) -> tuple[PublishedValues, Callable[[], None]]:
        """This round's value messages, counted as read until the returned callable is called (cut: what ends the
        reader's call, see _supersede). The caller holds the parameters' read lock, only while it calls this."""
        with self._values_lock:
            if self._values is None:
                self._values = self._new_values()
            values, closing = self._values, self._closing
            done = values.open(cut)
        if closing:  # the step is coming and the reader may be slow: made whole now, under the caller's read lock
            values.finish()
        return values, done

    def release_values(self) -> None:
        """The round closed and its outer step is coming (apply calls this before it takes the write lock and steps).

        A version nobody reads is closed now. One being read is finished (written whole to disk) now, and any
        opened from now until the step are finished as they are opened: after the step their readers go on from
        that copy at their own pace, and the step never waits for them.
        """
        with self._values_lock:
            self._closing = True
            values = self._values
            if values is not None and not values.readers:
                self._values = values = None
        if values is not None:
            values.finish()

    def _supersede(self) -> None:
        """The parameters change now (the caller holds the write lock): this round's value messages are superseded.

        Memory: a superseded version is kept only while someone reads it, and only one: the version superseded
        before it is dropped now and its readers are cut off (ROUND_CLOSED, or their call cancelled while they are
        stalled in a send), which frees its file and their server threads. So a reader has at least one whole
        round (from the publication after the one it started under to the next) to finish, however slow its link,
        and stalled readers hold at most one model's serialized values (4 bytes a parameter) on disk for at most two
        rounds, whatever their number. Chosen over
        keeping every version a reader holds, whose disk would be the attacker's to choose (one model for every
        round it stalls through), and over cutting readers off at the first publication, which would refuse an
        honest island on a slow link a model that takes longer to send than what is left of the round.
        """
        with self._values_lock:
            old, older = self._values, self._superseded
            self._values, self._closing = None, False
            kept = old is not None and old.readers and old.complete
            self._superseded = old if kept else None
        if old is not None and not kept:  # unread (its file, if any, goes), or never finished: not made from new values
            old.drop("the parameters changed while you read them; fetch again")
        if older is not None:
            older.drop("the parameters you were reading were superseded twice while you read them (a slow or stalled "
                       "read); fetch again")

    @torch.no_grad()
    def publish(self, step: Callable[[str, int, int], None] | None = None, into: DeltaStream | None = None) -> float:
        """Called after each outer step, under the parameters' write lock. With step (a lossy downlink): step(name,
        lo, hi) takes the outer step of each chunk's span just before the chunk is made, on the same thread, while
        the span is in cache; the chunks go to `into` in order as they are made, so pulls stream the update while
        the rest of it is made. Returns the seconds the threads spent making chunks (steps included), summed."""
        self._supersede()
        thread_s = 0.0
        if self.lossless:
            self.delta_chunks, self.delta_base = [], ""
        else:
            spans = [(name, lo, hi) for name, outer in self.outer_params.items()
                     for lo, hi in chunk_spans(outer.numel(), self.codec, self.chunk_bytes)]
            # Chunks are independent and the codecs' kernels and torch's elementwise ops release the GIL: the islands
            # wait for this, so it takes every core (each chunk's bytes are the same whichever thread makes it).
            # map hands the chunks back in order as they are made.
            made = (self.pool.map if self.pool is not None else map)(lambda span: self._publish_chunk(span, step), spans)
            chunks: list[pb.TensorChunk] = []
            for chunk, seconds in made:
                chunks.append(chunk)
                thread_s += seconds
                if into is not None:
                    into.extend([chunk])
            self.delta_chunks, self.delta_base = chunks, self.checksum
        self.checksum = self._checksum()
        return thread_s

    def release(self, name: str | None = None, lo: int = 0, hi: int | None = None) -> None:
        """Hands back the pages of a file-backed published copy that were read or written (elements [lo, hi) of name;
        all of them without a name): called after each use. Nothing to do with a lossless downlink."""
        if self.file is not None:
            self.file.release(name, lo, hi)

    def _checksum(self) -> str:
        return checksum(self.params, None if self.file is None else self.release)

    def unchanged(self) -> None:
        """A round that took no outer step: the parameters stay, so there is no update to send; a pull of the next
        round gets the values (lossless, the same checksum)."""
        self._supersede()
        self.delta_chunks, self.delta_base = [], ""

    @torch.no_grad()
    def _publish_chunk(self, span: tuple[str, int, int], step: Callable[[str, int, int], None] | None) -> tuple[pb.TensorChunk, float]:
        """One chunk of a lossy update, stepped (with step), subtracted, encoded, decoded and added while it is in cache;
        and the seconds it took."""
        started = time.perf_counter()
        name, lo, hi = span
        if step is not None:
            step(name, lo, hi)
        published, outer = self.params[name].view(-1)[lo:hi], self.outer_params[name].view(-1)[lo:hi]
        payload = self.codec.encode(outer - published)
        self.codec.decode_add(payload, published)  # what every island adds, bit for bit, with no decoded copy
        self.release(name, lo, hi)
        return make_chunk(name, lo, hi - lo, payload), time.perf_counter() - started

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.lossless:
            return {}
        state = {}
        for n, t in self.params.items():
            state[n] = t.clone()
            self.release(n)
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.lossless:
            for name, t in state.items():
                self.params[name].copy_(t)
                self.release(name)
        self._supersede()
        self.delta_chunks, self.delta_base = [], ""
        self.checksum = self._checksum()


def step_and_publish(publication: Publication, accumulator: PseudoGradientAccumulator, outer: OuterOptimizer,
                     into: DeltaStream) -> tuple[float, float]:
    """A closed round's mean divided, stepped and published one chunk's span at a time, on the publication's threads,
    into the stream pulls send from (outer.steps_by_parameter must hold, the downlink be lossy): each span is read
    once while in cache, not in three model-wide passes. The same bits as mean(), step(), publish(). Returns the
    step's and the publication's seconds: the wall time split in proportion to their thread-seconds."""
    mean_span, step_span = accumulator.mean_spans(), outer.span_step()
    stepped, lock, begun = [0.0], threading.Lock(), time.perf_counter()

    def step(name: str, lo: int, hi: int) -> None:
        t = time.perf_counter()
        step_span(name, lo, hi, mean_span(name, lo, hi))
        with lock:
            stepped[0] += time.perf_counter() - t

    thread_s = publication.publish(step, into)
    wall = time.perf_counter() - begun
    step_s = wall * stepped[0] / max(thread_s, 1e-9)
    return step_s, wall - step_s
