"""What islands hold: the published global parameters and the last round's update.

With a lossless downlink the published parameters are the outer optimizer's own.
With a lossy one the coordinator sends each round's update compressed and adds
exactly what it sent to its published copy, so the published copy and every
island's stay bit-identical; the outer parameters keep full precision and the
gap between the two (theta_outer - theta_published) is the downlink's error
feedback, carried into the next round's update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor

import torch

from diloco.codec import Codec
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.refusal import Reason, Refused
from diloco.params import checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.frames import serialized_values
from diloco.wire import chunk_spans, make_chunk


class SharedStream:
    """A sequence made once, on demand: whichever reader reaches the next item first makes it for all."""

    def __init__(self, source: Iterator):
        self._source, self._items, self._lock = source, [], threading.Lock()

    def __iter__(self) -> Iterator:
        i = 0
        while True:
            if i >= len(self._items):
                with self._lock:
                    if i >= len(self._items) and (item := next(self._source, None)) is not None:
                        self._items.append(item)
                if i >= len(self._items):
                    return
            yield self._items[i]
            i += 1


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


class Publication:
    def __init__(self, outer_params: Mapping[str, torch.Tensor], codec: Codec, chunk_bytes: int, pool: Executor | None = None):
        self.outer_params = outer_params
        self.pool = pool  # threads a lossy publication makes its chunks on (None: the caller's)
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.lossless = codec.name == "fp32"
        self.params = dict(outer_params) if self.lossless else {n: t.clone() for n, t in outer_params.items()}
        self.checksum = checksum(self.params)
        # The last round's update: it takes params with delta_base to params with checksum.
        self.delta_chunks: list[pb.TensorChunk] = []
        self.delta_base = ""
        self._values: SharedStream | None = None
        self._values_lock = threading.Lock()

    def value_messages(self) -> SharedStream:
        """The published parameters as serialized fp32 value messages (ResultMessage), with their sizes.

        Serialized once a round, chunk by chunk as the first pull streams them, and
        shared by every pull after it: one copy of the model however many islands,
        and no island waits for the whole model to be encoded before its first byte.
        Callers hold the parameters' read lock, so publish() cannot run meanwhile.
        """
        with self._values_lock:
            if self._values is None:
                self._values = SharedStream((b, len(b)) for b in serialized_values(self.params, self.chunk_bytes))
            return self._values

    def release_values(self) -> None:
        """The round closed: drop the value messages before the outer step needs memory (pulls under way keep theirs)."""
        with self._values_lock:
            self._values = None

    @torch.no_grad()
    def publish(self, step: Callable[[str, int, int], None] | None = None, into: DeltaStream | None = None) -> float:
        """Called after each outer step, under the parameters' write lock. With step (a lossy downlink): step(name,
        lo, hi) takes the outer step of each chunk's span just before the chunk is made, on the same thread, while
        the span is in cache; the chunks go to `into` in order as they are made, so pulls stream the update while
        the rest of it is made. Returns the seconds the threads spent making chunks (steps included), summed."""
        self._values = None  # a fetch during the fold may have serialized the values from before the step
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
        self.checksum = checksum(self.params)
        return thread_s

    def unchanged(self) -> None:
        """A round that took no outer step: the parameters stay, so there is no update to send; a pull of the next
        round gets the values (lossless, the same checksum)."""
        self._values = None
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
        return make_chunk(name, lo, hi - lo, payload), time.perf_counter() - started

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.lossless else {n: t.clone() for n, t in self.params.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if not self.lossless:
            for name, t in state.items():
                self.params[name].copy_(t)
        self.delta_chunks, self.delta_base, self._values = [], "", None
        self.checksum = checksum(self.params)


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
