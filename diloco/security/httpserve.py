"""One HTTP server for a process's own observability port: the coordinator's dashboard and metrics
(coordinator/web.py) and an island's --metrics-port (islands/telemetry.py). GET and HEAD of what a route function
answers, on threads of its own, apart from gRPC.

A connection costs no thread until its request is whole: one selector thread accepts connections and reads each
request's head (at most HEAD_BYTES), closing one that has not sent a whole head within head_timeout_s, and holds at
most max_connections (past that the oldest waiting is closed for the newest). A whole request goes to one of
`workers` threads, which answers it (`Connection: close`) within write_timeout_s. So clients that open connections,
send half a request and stop hold no thread, and a scrape among them is answered: with a thread a connection, 300 of
them took every thread an island allowed its port and its scrape was dropped.
"""

from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

# (path, query) -> (status, body, content type, extra headers)
Route = Callable[[str, str], tuple[int, bytes, str, dict[str, str]]]

HEAD_BYTES = 16 << 10  # a request line and headers: a browser's or a scraper's take a few hundred bytes


def text(status: int, body: str) -> tuple[int, bytes, str, dict[str, str]]:
    """A plain-text answer for a Route."""
    return status, body.encode(), "text/plain; charset=utf-8", {}


class HttpServer:
    """Serves route on host:port; the port is bound at construction (port 0: any free one, in .port). start() returns
    at once; stop() is idempotent and closes the port (also without start())."""

    def __init__(self, route: Route, host: str, port: int, name: str = "http", workers: int = 4,
                 head_timeout_s: float = 10.0, write_timeout_s: float = 30.0, max_connections: int = 1024,
                 headers: dict[str, str] | None = None, server: str = "diloco"):
        self.route, self.name, self.headers, self.server = route, name, dict(headers or {}), server
        self.workers, self.head_timeout_s, self.write_timeout_s = workers, head_timeout_s, write_timeout_s
        self.max_connections = max_connections
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.host, self.port = host, self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._waiting: dict[socket.socket, tuple[float, bytearray]] = {}  # connection -> (deadline, head so far)
        self._work: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start(self) -> HttpServer:
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"this {self.name} server was stopped; make a new one")
            if not self._threads:
                self._threads = [threading.Thread(target=self._accept_and_read, name=f"{self.name}-http", daemon=True)]
                self._threads += [threading.Thread(target=self._answer_requests, name=f"{self.name}-http-{i}", daemon=True)
                                  for i in range(self.workers)]
                for t in self._threads:
                    t.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            threads, self._threads = self._threads, []
        self._wake_w.send(b"x")
        for _ in range(self.workers):
            self._work.put(None)
        for t in threads:
            t.join(5.0)
        for conn in list(self._waiting):
            conn.close()
        self._waiting.clear()
        while True:  # requests no worker took
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._selector.close()

    # --- the selector thread: accepting, and reading heads ----------------------------------------------

    def _accept_and_read(self) -> None:
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        while not self._stopped:
            now = time.monotonic()
            nearest = min((d for d, _ in self._waiting.values()), default=now + 0.5)
            for key, _ in self._selector.select(max(0.0, min(nearest - now, 0.5))):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj is not self._wake_r:
                    self._read(key.fileobj)
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in self._waiting.items() if deadline <= now]:
                log.debug("%s: closed a connection that sent no whole request within %.0f s", self.name, self.head_timeout_s)
                self._drop(conn)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, say: the next select tries again
                log.warning("%s: cannot accept a connection (%s)", self.name, e)
                return
            if len(self._waiting) >= self.max_connections:  # the oldest waiting makes room
                self._drop(min(self._waiting, key=lambda c: self._waiting[c][0]))
            conn.setblocking(False)
            self._waiting[conn] = (time.monotonic() + self.head_timeout_s, bytearray())
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        head = self._waiting[conn][1]
        head += data
        if not data or len(head) > HEAD_BYTES:
            self._drop(conn)
        elif b"\r\n\r\n" in head:
            self._selector.unregister(conn)
            del self._waiting[conn]
            self._work.put((conn, bytes(head)))

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._waiting[conn]
        conn.close()

    # --- the workers: answering ---------------------------------------------------------------------------

    def _answer_requests(self) -> None:
        while (item := self._work.get()) is not None:
            conn, head = item
            try:
                conn.setblocking(True)
                conn.settimeout(self.write_timeout_s)
                conn.sendall(self._response(head))
            except OSError as e:  # a client that went away or reads too slowly
                log.debug("%s: answering a request failed (%s)", self.name, e)
            finally:
                conn.close()

    def _response(self, head: bytes) -> bytes:
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        method = parts[0] if len(parts) == 3 else ""
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            status, body, kind, headers = text(HTTPStatus.BAD_REQUEST, "bad request line\n")
        elif method not in ("GET", "HEAD"):
            status, body, kind, headers = text(HTTPStatus.METHOD_NOT_ALLOWED, "GET or HEAD only\n")
            headers = {"Allow": "GET, HEAD"}
        else:
            url = urlsplit(parts[1])
            try:
                status, body, kind, headers = self.route(url.path, url.query)
            except Exception:  # noqa: BLE001 - one failing request must not take the server down
                log.exception("%s: %s failed", self.name, url.path)
                status, body, kind, headers = text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error\n")
        lines = [f"HTTP/1.1 {int(status)} {HTTPStatus(status).phrase}", f"Server: {self.server}",
                 f"Date: {formatdate(usegmt=True)}", f"Content-Type: {kind}", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{k}: {v}" for k, v in {**self.headers, **headers}.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if method == "HEAD" else body)
