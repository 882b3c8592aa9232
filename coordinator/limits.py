"""What one island may take of the coordinator: open streams, heartbeats, joins, time between chunks, push slots,
the largest message.

Each bound is refused with its own reason (diloco/wire/refusal.py), so a client
sees a precise status and an honest island, which never comes near a bound,
never pays for one. The spool's disk bound lives with the spool
(coordinator/spool.py); idle islands are removed by membership.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from diloco.config import RunConfig
from diloco.policy import LimitsConfig
from diloco.robust import SKETCH_BYTES
from diloco.wire.refusal import Reason, Refused


def max_message_bytes(cfg: RunConfig) -> int:
    """The largest message the coordinator takes: a chunk of wire.chunk_bytes with its header, plus room for the
    largest codec's per-chunk overhead (scales, positions); at least one contribution's direction sketch, which a
    shard sends its leader (coordinator/judging.py: more than one goes in pieces of this size)."""
    return max(2 * cfg.wire.chunk_bytes, SKETCH_BYTES) + (64 << 10)


class TokenBucket:
    """At most `rate` events a second on average, in bursts of at most `burst`."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]):
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.at = burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Limits:
    """Per-island counters and rate buckets; thread-safe. ranks: what the island declared at join, within what
    the run allows it (its certificate's ranks, or rounds.max_island_ranks: coordinator/service.py), so a bound
    that scales with ranks never scales with an island's word alone. Heartbeat buckets exist for members only
    (the service checks membership first), so made-up island ids cannot grow them."""

    def __init__(self, cfg: LimitsConfig, heartbeat_s: float, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.heartbeat_s, self.clock = cfg, heartbeat_s, clock
        self._open: dict[tuple[str, str], int] = {}  # (kind, island) -> streams open now
        self._heartbeats: dict[str, TokenBucket] = {}
        self._joins: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    @contextmanager
    def stream(self, kind: str, island_id: str, ranks: int) -> Iterator[None]:
        """Counts a stream of `kind` open for the island; refuses one beyond its bound (a flood of open streams)."""
        bound = self.cfg.push_streams_per_rank * ranks + 2
        key = (kind, island_id)
        with self._lock:
            if self._open.get(key, 0) >= bound:
                raise Refused(Reason.TOO_MANY_STREAMS, f"{island_id} has {bound} {kind} streams open already "
                              "(limits.push_streams_per_rank x its ranks, + 2)")
            self._open[key] = self._open.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._open[key] -= 1
                if not self._open[key]:
                    del self._open[key]

    def heartbeat(self, island_id: str, ranks: int) -> None:
        rate = self.cfg.heartbeats_per_interval * ranks / self.heartbeat_s
        with self._lock:
            bucket = self._heartbeats.get(island_id)
            if bucket is None or bucket.rate != rate:
                bucket = self._heartbeats[island_id] = TokenBucket(rate, max(4.0, 2 * rate * self.heartbeat_s), self.clock)
            allowed = bucket.take()
        if not allowed:
            raise Refused(Reason.RATE_LIMITED, f"{island_id} heartbeats faster than limits.heartbeats_per_interval = "
                          f"{self.cfg.heartbeats_per_interval:g} per rank every {self.heartbeat_s:g}s")

    def join(self, credential: str) -> None:
        per_minute = self.cfg.joins_per_minute
        with self._lock:
            bucket = self._joins.setdefault(credential, TokenBucket(per_minute / 60.0, per_minute, self.clock))
            allowed = bucket.take()
        if not allowed:
            raise Refused(Reason.RATE_LIMITED, f"{credential!r} joins more often than limits.joins_per_minute = {per_minute:g}")

    def forget(self, island_id: str) -> None:
        """The island left: its heartbeat bucket goes (a credential's join bucket stays: it bounds rejoining)."""
        with self._lock:
            self._heartbeats.pop(island_id, None)


class Abandoned(Exception):
    """A push gave up its place in the queue for a slot: its caller went away, or the coordinator is stopping."""


class PushSlots:
    """Push streams the coordinator reads at once, all islands together (limits.push_slots; 0: no bound).

    gRPC buffers up to limits.receive_window_mb of every stream the coordinator
    has not read yet, and on a coordinator whose cores fall behind every open
    push fills its window: memory that grows with the islands and ranks pushing
    at once. A push waits here after its header, before its chunks are read,
    and an island sends nothing more until the coordinator's initial metadata
    says it was admitted (islands/client.py push). What the transport holds for
    pushes is then at most push_slots windows.

    No island holds more than its share, max(1, push_slots // members), so an
    island that keeps streams open (a stolen key trickling chunks) holds at most
    that many and the others the rest. Among the waiting, the earliest whose
    island is under its share goes first.
    """

    def __init__(self, slots: int, members: Callable[[], int]):
        self.slots, self.members = slots, members
        self._held: dict[str, int] = {}  # island -> slots it holds now
        self._waiting: list[tuple[object, str]] = []  # (ticket, island), in arrival order
        self._cond = threading.Condition()

    def share(self) -> int:
        return max(1, self.slots // max(1, self.members()))

    @contextmanager
    def slot(self, island_id: str, still_wanted: Callable[[], bool]) -> Iterator[None]:
        """Holds one slot for the island while the block runs; waits for it first, and raises Abandoned once
        still_wanted() says no (the caller gone, or the coordinator stopping)."""
        if self.slots <= 0:
            yield
            return
        ticket = object()
        with self._cond:
            self._waiting.append((ticket, island_id))
            try:
                while not self._admissible(ticket):
                    if not still_wanted():
                        raise Abandoned(f"{island_id}'s push gave up waiting for a push slot")
                    self._cond.wait(0.5)
            finally:
                self._waiting.remove((ticket, island_id))
                self._cond.notify_all()  # the next waiter may be admissible now
            self._held[island_id] = self._held.get(island_id, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._held[island_id] -= 1
                if not self._held[island_id]:
                    del self._held[island_id]
                self._cond.notify_all()

    def _admissible(self, ticket: object) -> bool:
        """Whether ticket is among the waiters that the free slots go to: in arrival order, skipping those whose
        island holds its share already (counting the waiters ahead that go in)."""
        free, share, held = self.slots - sum(self._held.values()), self.share(), dict(self._held)
        for waiting, island in self._waiting:
            if free <= 0:
                return False
            if held.get(island, 0) < share:
                if waiting is ticket:
                    return True
                free -= 1
                held[island] = held.get(island, 0) + 1
        return False

    def status(self) -> dict[str, int]:
        """For /metrics: slots held and pushes waiting now, and the bound (0: none)."""
        with self._cond:
            return {"held": sum(self._held.values()), "waiting": len(self._waiting), "bound": self.slots}


_END = object()


def _message_bytes(message) -> int:
    size = getattr(message, "size", None)  # a ChunkView knows its message's size
    return size if isinstance(size, int) else message.ByteSize()


def idle_bounded(messages: Iterator, idle_s: float, floor_bytes_per_s: float = 0.0) -> Iterator:
    """A client stream's messages, refused (STREAM_IDLE) when none comes for idle_s seconds, or when the client
    has kept the handler waiting longer than idle_s plus what its bytes need at floor_bytes_per_s (0: no floor).

    The floor stops a member that trickles a chunk just inside idle_s from holding a round to its deadline. Only
    the time spent waiting on the client counts, never the time the coordinator takes with what it received, so a
    busy coordinator does not cut off an honest push.

    gRPC's request iterator blocks without a timeout, so a reader thread feeds
    a short queue (at most a few chunks held: memory stays bounded) and the
    handler waits on the queue. Once the handler is done the call ends, which
    ends the reader's blocked read.
    """
    inbox: queue.Queue = queue.Queue(maxsize=4)
    done = threading.Event()

    def put(item) -> bool:
        while not done.is_set():
            try:
                inbox.put(item, timeout=0.5)
                return True
            except queue.Full:
                pass
        return False

    def read() -> None:
        try:
            for message in messages:
                if not put(message):
                    return
            put(_END)
        except BaseException as e:  # the client cancelled (grpc.RpcError), or the call ended under the reader
            put(e)

    threading.Thread(target=read, name="push-reader", daemon=True).start()
    waited = received = 0.0  # seconds spent waiting on the client; bytes it sent
    try:
        while True:
            allowed = idle_s + received / floor_bytes_per_s - waited if floor_bytes_per_s > 0 else idle_s
            started = time.monotonic()
            try:
                item = inbox.get(timeout=max(min(idle_s, allowed), 0.0))
            except queue.Empty:
                if allowed < idle_s:
                    raise Refused(Reason.STREAM_IDLE, f"the push stream sent {received / 1e6:.3f} MB in {waited:.0f}s of waiting on it, "
                                  f"below limits.push_floor_mbps: cut off, and what it sent was dropped") from None
                raise Refused(Reason.STREAM_IDLE, f"the push stream sent nothing for {idle_s:g}s (limits.push_idle_s): "
                              "cut off, and what it sent was dropped") from None
            waited += time.monotonic() - started
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            received += _message_bytes(item)
            yield item
    finally:
        done.set()
