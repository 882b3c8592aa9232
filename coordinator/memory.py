"""What the coordinator holds in memory, by component, counted from the live objects.

CoordinatorState.memory() walks what each fragment keeps from round to round and
names each part (COMPONENTS, in the order counted); a tensor's storage is counted
once, by the first component that holds it, so views and shared tensors (the
published parameters are the outer optimizer's own with a lossless downlink)
are not counted twice. Tensors count their storage's bytes exactly; serialized
messages their sizes; the spool's pool the blocks it allocated (kept once
allocated, whether a spool holds them now or not).

What is not here is the rest of the process's resident memory: the Python and
torch runtime, gRPC's buffers (messages being received and sent), the allocator's
slack (memory freed but kept by malloc), a checkpoint's copies while it is
written, and what a reader still sending an older update holds. A benchmark
reports it as the process's peak (VmHWM) less the sum of the components
(benchmarks/exchange.py).

MemoryPeaks keeps the most each component held over the run, sampled by the
round driver around each close (coordinator/hooks.py MemorySampling): before the fold,
when the round's pushes sit in the pool and the last round's values may still
be held, and after the outer step and the publication.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

log = logging.getLogger(__name__)

# Each component, and what it is: the names the report, /metrics and the exchange benchmark print.
COMPONENTS = {
    "outer_params": "the global parameters theta in fp32, the outer optimizer's (with a lossless downlink what islands hold)",
    "momentum": "the outer Nesterov momentum (delayed Nesterov's carry)",
    "accumulator": "the round's token-weighted sum of pseudo-gradients, divided in place into the mean",
    "accumulator_late": "delayed Nesterov's sum of late contributions (allocated at the first one)",
    "published_values": "the published values' chunk digests: each pull's messages are framed from the parameters as "
                        "it reads (a version read across a step is written to disk: values_on_disk in the report)",
    "delta_chunks": "the lossy downlink's last update, encoded, for pulls that take a delta",
    "eager_mean": "the round's mean pseudo-gradient, encoded, for eager updates",
    "sketches": "the direction check's sketch of each contribution held (robust.direction_check, 3+ islands)",
    "spool_pool": "the spool's memory pool: blocks allocated, kept once filled (limits.spool_memory_models)",
    "evaluator": "the evaluators' model copies and held-out batches (eval.batches, eval.hellaswag)",
}


class StorageCounter:
    """Bytes of tensor storage, each storage counted once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def count(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key, size = (str(storage.device), storage.data_ptr()), storage.nbytes()
            if size and key not in self._seen:
                self._seen.add(key)
                total += size
        return total


def held_tensors(obj, depth: int = 3) -> Iterator[torch.Tensor]:
    """The tensors an object holds: a tensor, a module's parameters and buffers, and what lists, tuples, dicts and a
    function's closure hold, depth levels down (an evaluator is a closure over its model and batches)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif depth <= 0:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from held_tensors(item, depth - 1)
    elif isinstance(obj, Mapping):
        for item in list(obj.values()):
            yield from held_tensors(item, depth - 1)
    elif callable(obj) and getattr(obj, "__closure__", None):
        for cell in obj.__closure__:
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from held_tensors(contents, depth - 1)


def message_bytes(messages: Iterable) -> int:
    """The serialized size of protocol messages (a chunk's payload and its address), each message once."""
    seen, total = set(), 0
    for m in messages:
        if id(m) not in seen:
            seen.add(id(m))
            total += m.ByteSize()
    return total


def fragment_memory(fragment, counter: StorageCounter, closing=None) -> dict[str, int]:
    """One fragment's components (coordinator/rounds.py FragmentRounds), its tensors counted by counter; closing: the
    round it is closing (rounds.py Closing), whose contributions it no longer holds itself."""
    outer, publication, accumulator = fragment.outer, fragment.publication, fragment.accumulator
    momentum = [state["momentum_buffer"] for state in list(outer.optimizer.state.values())
                if state.get("momentum_buffer") is not None]
    late = accumulator.late_sums
    held = [*list(fragment.contributions.values()), *(list(fragment.late.held.values()) if fragment.late else []),
            *(c for _, c in (closing.contributions if closing is not None else []))]
    sketches = {id(c.sketch): c.sketch for c in held if isinstance(c.sketch, np.ndarray)}.values()
    stream = fragment.streaming  # a lossy update being made: its chunks are delta_chunks once published
    return {
        "outer_params": counter.count(outer.params.values()),
        "momentum": counter.count([*momentum, *(outer.carry or {}).values()]),
        "accumulator": counter.count(accumulator.sums.values()),
        "accumulator_late": counter.count(late.values()) if late is not None else 0,
        "published_values": publication.held_values()["published_values"],
        "delta_chunks": message_bytes([*publication.delta_chunks, *(list(stream.chunks) if stream is not None else [])]),
        "eager_mean": message_bytes(fragment.mean_chunks),
        "sketches": sum(s.nbytes for s in sketches),
    }


def state_memory(state, closing: tuple | None = None) -> dict[str, int]:
    """The whole coordinator's components (CoordinatorState.memory), each fragment's parts summed; closing: (fragment
    index, rounds.py Closing) of a round being closed."""
    counter = StorageCounter()
    total = dict.fromkeys(COMPONENTS, 0)
    for f in state.fragments:
        for name, n in fragment_memory(f, counter, closing[1] if closing and closing[0] == f.index else None).items():
            total[name] += n
    total["spool_pool"] = state.spools.pool.allocated_bytes
    total["evaluator"] = counter.count(t for fn in (state.evaluate, state.tasks) if fn is not None for t in held_tensors(fn))
    return total


def process_rss() -> dict[str, int]:
    """This process's resident memory now (VmRSS) and at its peak (VmHWM), in bytes; {} where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


class MemoryPeaks:
    """The most each component held over the samples taken, and the sample whose components summed the most (with
    the process's resident memory then)."""

    def __init__(self, measure: Callable[[], dict[str, int]]):
        self.measure = measure
        self.peak: dict[str, int] = {}
        self.at_peak_total: dict[str, int] = {}
        self.rss_at_peak_total = 0
        self.samples = 0
        self._lock = threading.Lock()

    def sample(self, *args) -> dict[str, int]:
        """Measures now (measure(*args)) and keeps the peaks; an accounting that fails is logged, never raised (the
        round driver calls this)."""
        try:
            now = self.measure(*args)
        except Exception:  # noqa: BLE001 - what the run shows must never stop it
            log.warning("could not account for the coordinator's memory", exc_info=True)
            return {}
        rss = process_rss().get("VmRSS", 0)
        with self._lock:
            self.samples += 1
            for name, n in now.items():
                self.peak[name] = max(self.peak.get(name, 0), n)
            if sum(now.values()) >= sum(self.at_peak_total.values()):
                self.at_peak_total, self.rss_at_peak_total = dict(now), rss
        return now

    def report(self) -> dict:
        with self._lock:
            return {"peak": dict(self.peak), "peak_sum": sum(self.peak.values()), "at_peak_total": dict(self.at_peak_total),
                    "rss_at_peak_total": self.rss_at_peak_total, "samples": self.samples}


class FreedMemory:
    """Hands memory the process freed back to the OS, where the allocator is glibc's (else does nothing).

    glibc keeps what a thread frees in that thread's arena for its next allocation: after a round, the pushes' and
    pulls' message buffers (a megabyte a chunk, made and freed by many gRPC threads at once) stay resident as slack
    that grows with the number of islands. Fewer arenas (M_ARENA_MAX) make threads reuse each other's free memory, and
    malloc_trim returns the free pages: after each close, and at most once a second while pushes arrive (the slack
    their buffers leave mid-round was 0.47x the fp32 model at 125M with 8 islands). Opt-out for a measurement:
    DILOCO_MALLOC_TUNING=0.
    """

    M_ARENA_MAX = -8  # glibc's mallopt parameter

    def __init__(self, arenas: int = 2) -> None:
        self._libc = None
        self._last = 0.0
        self._lock = threading.Lock()
        if os.environ.get("DILOCO_MALLOC_TUNING", "1") == "0":
            return
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.malloc_trim, libc.mallopt  # noqa: B018 - glibc only: raises AttributeError elsewhere (musl, macOS)
        except (OSError, AttributeError):
            return
        libc.mallopt(self.M_ARENA_MAX, arenas)
        self._libc = libc

    def trim(self, at_most_every_s: float = 0.0) -> None:
        """Hands the free pages back; with at_most_every_s, not if it did less than that many seconds ago."""
        if self._libc is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < at_most_every_s:
                return
            self._last = now
        self._libc.malloc_trim(0)
