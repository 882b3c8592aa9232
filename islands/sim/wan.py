"""Emulated WAN links for one-node runs: a throttling TCP proxy on 127.0.0.1.

A `WanLink` listens on its own port and forwards every connection to a target
(the coordinator). Each direction of each connection is a model of one link of
bandwidth B and one-way delay d: a read of n bytes entering at time t starts
transmission at max(t, end of the previous transmission), finishes n/B later
(a token bucket whose burst is one read: ~2 ms of rate, at least 1500 bytes,
at most 256 KiB), and is delivered d after that. Delivery is a delay line, so any number of bytes can be
in flight (a long fat link keeps its full rate), and the proxy reads only while
it holds less than the bandwidth-delay product plus ~20 ms of queue, so a fast
sender is slowed by TCP backpressure exactly as by a real bottleneck.
A new connection costs what TCP's handshake costs: the client's first bytes
arrive 1.5 round trips (3d) after it connects, and so do the target's.

Specs are RATE:DELAY, e.g. `100mbit:80ms`, `1gbit:50ms`, `10mbit:0ms`,
`500kbit:120ms`: RATE in bit, kbit, mbit or gbit per second (powers of 1000,
as in tc), DELAY in us, ms or s. `kbps`-style units are refused: tc reads them
as bytes per second, most people as bits, so they are ambiguous.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

SPEC_HELP = "expected RATE:DELAY such as 100mbit:80ms (RATE in kbit, mbit or gbit per second; DELAY in us, ms or s)"
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"


class WanSpecError(ValueError):
    """A link spec that cannot be used; the message says what is wrong and what is expected."""


@dataclass(frozen=True)
class LinkSpec:
    bits_per_s: float
    delay_s: float
    text: str = ""

    @property
    def bytes_per_s(self) -> float:
        return self.bits_per_s / 8

    def __str__(self) -> str:
        return self.text or f"{self.bits_per_s / 1e6:g}mbit:{self.delay_s * 1e3:g}ms"


def parse_link(text: str) -> LinkSpec:
    """One link, e.g. '100mbit:80ms'."""
    spec = text.strip().lower()
    rate, sep, delay = spec.partition(":")
    if not sep:
        raise WanSpecError(f"bad link {text!r}: no ':' between rate and delay; {SPEC_HELP}")
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", rate.strip())
    if not m:
        raise WanSpecError(f"bad rate {rate!r} in {text!r}; {SPEC_HELP}")
    if m.group(2) not in _RATE_UNITS:
        hint = " (bytes or bits? write kbit, mbit or gbit)" if m.group(2).endswith(("bps", "b/s")) else ""
        raise WanSpecError(f"unknown rate unit {m.group(2)!r} in {text!r}{hint}; {SPEC_HELP}")
    bits = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if not 1e3 <= bits <= 100e9:
        raise WanSpecError(f"rate {rate!r} in {text!r} is outside 1kbit..100gbit; {SPEC_HELP}")
    m = re.fullmatch(_NUMBER + r"\s*([a-z]+)", delay.strip())
    if not m or m.group(2) not in _DELAY_UNITS:
        raise WanSpecError(f"bad delay {delay!r} in {text!r}; {SPEC_HELP}")
    seconds = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if seconds > 10:
        raise WanSpecError(f"delay {delay!r} in {text!r} is over 10s; {SPEC_HELP}")
    return LinkSpec(bits, seconds, text.strip())


def parse_wan(text: str, links: int) -> list[LinkSpec]:
    """One spec for every link ('100mbit:80ms') or one per link ('1gbit:20ms,100mbit:80ms')."""
    specs = [parse_link(part) for part in text.split(",")]
    if len(specs) == 1:
        return specs * links
    if len(specs) != links:
        raise WanSpecError(f"{len(specs)} link specs for {links} islands; give one spec for all or one per island")
    return specs


class _Direction:
    """One direction of one proxied connection: reader -> serialization -> delay line -> writer."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, spec: LinkSpec, start_at: float):
        self.conn, self.src, self.dst = conn, src, dst
        self.rate, self.delay = spec.bytes_per_s, spec.delay_s
        self.read_size = int(min(262144, max(1500, self.rate * 0.002)))
        self.limit = int(self.rate * self.delay + max(4 * self.read_size, self.rate * 0.02))
        self.free_at = start_at  # when the link finishes transmitting what it holds
        self.line: deque[tuple[float, bytes]] = deque()  # (delivery time, data), in order
        self.held = 0
        self.eof = False
        self.carried = 0
        self.cond = threading.Condition()

    def read_loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.held >= self.limit and not self.conn.closed:
                        self.cond.wait(0.5)
                if self.conn.closed:
                    return
                data = self.src.recv(self.read_size)
                now = time.monotonic()
                with self.cond:
                    if not data:
                        self.eof = True
                        self.cond.notify_all()
                        return
                    self.free_at = max(now, self.free_at) + len(data) / self.rate
                    self.line.append((self.free_at + self.delay, data))
                    self.held += len(data)
                    self.cond.notify_all()
        except OSError:
            self.conn.abort()

    def write_loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.line and not self.eof and not self.conn.closed:
                        self.cond.wait(0.5)
                    if self.conn.closed:
                        return
                    if not self.line:  # the sender closed and everything was delivered
                        break
                    due = self.line[0][0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, 0.05))
                    continue
                parts, size = [], 0
                with self.cond:
                    now = time.monotonic()
                    while self.line and self.line[0][0] <= now and size < 1 << 20:
                        data = self.line.popleft()[1]
                        parts.append(data)
                        size += len(data)
                self.dst.sendall(parts[0] if len(parts) == 1 else b"".join(parts))
                with self.cond:
                    self.held -= size
                    self.carried += size
                    self.cond.notify_all()
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            self.conn.abort()
        finally:
            self.conn.writer_done()


class _Connection:
    def __init__(self, link: WanLink, client: socket.socket, server: socket.socket):
        self.link, self.client, self.server = link, client, server
        self.closed = False
        self._lock = threading.Lock()
        self._writers_left = 2
        # TCP's handshake: the client may send after one round trip (SYN, SYN-ACK); the
        # server's end exists after 1.5 (the final ACK), so nothing crosses the link earlier.
        now, d = time.monotonic(), link.spec.delay_s
        self.up = _Direction(self, client, server, link.spec, now + 2 * d)
        self.down = _Direction(self, server, client, link.spec, now + 3 * d)
        self.threads = [
            threading.Thread(target=fn, name=f"wan-{link.port}-{name}", daemon=True)
            for name, fn in (("up-read", self.up.read_loop), ("up-write", self.up.write_loop),
                             ("down-read", self.down.read_loop), ("down-write", self.down.write_loop))
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def writer_done(self) -> None:
        with self._lock:
            self._writers_left -= 1
            last = self._writers_left == 0
        if last:
            self.abort()

    def abort(self) -> None:
        """Closes both sockets (ends every thread of the connection); safe to call more than once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for d in (self.up, self.down):
            with d.cond:
                d.cond.notify_all()
        self.link._forget(self)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        for s in (self.client, self.server):
            s.close()


class WanLink:
    """A listening port on 127.0.0.1 that forwards to `target` through an emulated link.

    `bytes_up` counts what was delivered from the clients to the target, `bytes_down`
    the other way. Use start()/stop(), or `with WanLink(...) as link:`.
    """

    def __init__(self, target: tuple[str, int], spec: LinkSpec | str, host: str = "127.0.0.1", port: int = 0):
        self.target = target
        self.spec = parse_link(spec) if isinstance(spec, str) else spec
        self.host, self.port = host, port
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._live: set[_Connection] = set()
        self._reapers: set[threading.Thread] = set()
        self._up_done = self._down_done = 0
        self.connections = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bytes_up(self) -> int:
        with self._lock:
            return self._up_done + sum(c.up.carried for c in self._live)

    @property
    def bytes_down(self) -> int:
        with self._lock:
            return self._down_done + sum(c.down.carried for c in self._live)

    def start(self) -> WanLink:
        self._listener = socket.create_server((self.host, self.port))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._accepter = threading.Thread(target=self._accept_loop, name=f"wan-{self.port}-accept", daemon=True)
        self._accepter.start()
        return self

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()  # the target is down: the client sees a refused connection
                continue
            for s in (client, server):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client, server)
            with self._lock:
                if self._stopping.is_set():
                    client.close()
                    server.close()
                    return
                self._live.add(conn)
                self.connections += 1
            conn.start()

    def _forget(self, conn: _Connection) -> None:
        # Reap the connection's threads and sockets without blocking the caller (stop() waits).
        reaper = threading.Thread(target=self._reap, args=(conn,), name=f"wan-{self.port}-reap", daemon=True)
        with self._lock:
            self._reapers.add(reaper)
        reaper.start()

    def _reap(self, conn: _Connection) -> None:
        conn.join(5.0)
        with self._lock:
            if conn in self._live:
                self._live.discard(conn)
                self._up_done += conn.up.carried
                self._down_done += conn.down.carried
            self._reapers.discard(threading.current_thread())

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the listener and every connection, and joins every thread."""
        self._stopping.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            except OSError:
                pass
        if self._accepter is not None:
            self._accepter.join(timeout_s)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            live = list(self._live)
        for conn in live:
            conn.abort()
        for conn in live:
            conn.join(timeout_s)
        while True:
            with self._lock:
                reapers = list(self._reapers)
            if not reapers:
                break
            for reaper in reapers:
                reaper.join(timeout_s)

    def __enter__(self) -> WanLink:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
