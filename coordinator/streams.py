"""The read streams open now (WatchRounds, FetchParameters, PullRoundResult), by the credential of their caller.

Each holds one of the gRPC server's threads for as long as it lasts (a watch for the whole run). So watch
streams are bounded per credential and in all (limits.watch_streams_per_credential, limits.watch_streams; refused
TOO_MANY_STREAMS): an island's key, valid or stolen, cannot take the threads pushes and heartbeats need. And a
credential's open streams end once it is revoked: a stream that is waiting (a watch between rounds, a pull for
its round) or sending is refused REVOKED at its next look, at most sweep_s after the revocation list says so; one
stalled in a send, whose client reads nothing and so would never see a refusal, is cancelled grace_s later.
Without mutual TLS there is no credential: only the total bound holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from diloco.policy import LimitsConfig
from diloco.wire.refusal import Reason, Refused

log = logging.getLogger(__name__)


class Ticket:
    """One open stream: check() between messages refuses it once its credential is revoked."""

    def __init__(self, kind: str, credential: str | None, cancel: Callable[[], None]):
        self.kind, self.credential, self.cancel = kind, credential, cancel
        self.revoked_at: float | None = None
        self.cancelled = False

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def check(self) -> None:
        if self.revoked_at is not None:
            raise Refused(Reason.REVOKED, f"the credential {self.credential!r} was revoked; it is out of the run")


class OpenStreams:
    """The open read streams; thread-safe. revoked(credential): whether it is revoked now; wake(): wakes every wait
    on the coordinator's condition (watches, pulls), so that they look at their ticket."""

    def __init__(self, cfg: LimitsConfig, revoked: Callable[[str], bool], wake: Callable[[], None], stop: threading.Event,
                 sweep_s: float = 0.5, grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.revoked, self.wake, self.stop = cfg, revoked, wake, stop
        self.sweep_s, self.grace_s, self.clock = sweep_s, grace_s, clock
        self._open: set[Ticket] = set()
        self._watches: dict[str | None, int] = {}  # credential (None: without TLS) -> watch streams open
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None

    @contextmanager
    def open(self, kind: str, credential: str | None, cancel: Callable[[], None] = lambda: None) -> Iterator[Ticket]:
        """Counts a stream of kind ("watch", "fetch", "pull") open for credential until the context ends; refuses a
        watch beyond its bounds. cancel ends the call (for a stream stalled in a send)."""
        ticket = Ticket(kind, credential, cancel)
        with self._lock:
            if kind == "watch":
                self._admit_watch(credential)
            self._open.add(ticket)
            if credential is not None and self._sweeper is None:
                self._sweeper = threading.Thread(target=self._sweep_until_stopped, name="stream-sweeper", daemon=True)
                self._sweeper.start()
        try:
            yield ticket
        finally:
            with self._lock:
                self._open.discard(ticket)
                if kind == "watch":
                    self._watches[credential] -= 1
                    if not self._watches[credential]:
                        del self._watches[credential]

    def _admit_watch(self, credential: str | None) -> None:
        """Caller holds _lock."""
        total, bound = sum(self._watches.values()), self.cfg.watch_streams
        if total >= bound:
            raise Refused(Reason.TOO_MANY_STREAMS, f"{total} round watches are open already (limits.watch_streams = {bound})")
        mine, per = self._watches.get(credential, 0), self.cfg.watch_streams_per_credential
        if credential is not None and mine >= per:
            raise Refused(Reason.TOO_MANY_STREAMS, f"{credential!r} has {mine} round watches open already "
                          f"(limits.watch_streams_per_credential = {per})")
        self._watches[credential] = mine + 1

    def count(self, kind: str, credential: str | None = None) -> int:
        with self._lock:
            return sum(1 for t in self._open if t.kind == kind and (credential is None or t.credential == credential))

    def sweep(self) -> None:
        """Marks the streams of revoked credentials (they are refused at their next look) and cancels those still open
        grace_s after."""
        now = self.clock()
        with self._lock:
            tickets = [t for t in self._open if t.credential is not None]
        revoked = {c for c in {t.credential for t in tickets} if self.revoked(c)}
        marked = False
        for t in tickets:
            if t.credential not in revoked:
                continue
            if t.revoked_at is None:
                t.revoked_at, marked = now, True
                log.warning("the credential %r was revoked: its open %s stream ends", t.credential, t.kind)
            elif now - t.revoked_at >= self.grace_s and not t.cancelled:
                t.cancelled = True
                log.warning("%r's %s stream (revoked) had not ended %gs after; cancelled", t.credential, t.kind, self.grace_s)
                t.cancel()
        if marked:
            self.wake()

    def _sweep_until_stopped(self) -> None:
        while not self.stop.wait(self.sweep_s):
            try:
                self.sweep()
            except Exception:  # the revocation list or a cancel failing must not end the sweeps
                log.exception("sweeping the open streams failed; trying again")
