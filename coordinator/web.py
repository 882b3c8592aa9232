"""The coordinator's own HTTP port: the live dashboard, its JSON API, and the metrics.

A stdlib ThreadingHTTPServer on its own thread, apart from the gRPC server, so a
slow browser never holds a thread islands need. Routes:

  GET /                the dashboard (coordinator/dashboard/index.html)
  GET /static/<name>   one of the dashboard's files, by exact name (nothing else is reachable)
  GET /api/run?since=N run_snapshot() as JSON, rounds from position N on (coordinator/snapshot.py)
  GET /metrics         what the metrics callable returns (404 without one)
  GET /healthz         "ok"

Every asset ships inside the package and is read once at construction through
importlib.resources, so the page works with no internet and from a wheel. The port
has no authentication: it binds loopback by default (the dashboard shows island
hostnames and the run's progress; put it behind something that authenticates before
exposing it).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlsplit

from coordinator.snapshot import run_snapshot
from coordinator.state import CoordinatorState
from diloco.security.net import is_loopback

log = logging.getLogger(__name__)

__all__ = ["RunWebServer", "dashboard_assets"]

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}
# The page may load only what this server serves: a stray remote URL would fail loudly, not leak.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def dashboard_assets() -> dict[str, tuple[bytes, str]]:
    """The dashboard's files by name: (contents, content type). Only known kinds of file are served."""
    folder = resources.files("coordinator").joinpath("dashboard")
    assets = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2] if "." in entry.name else ""
        if entry.is_file() and suffix in CONTENT_TYPES and not entry.name.startswith("."):
            assets[entry.name] = (entry.read_bytes(), CONTENT_TYPES[suffix])
    if "index.html" not in assets:
        raise FileNotFoundError("coordinator/dashboard/index.html is not in the package (package-data in pyproject.toml?)")
    return assets


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser holding a keep-alive connection never blocks shutdown
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        # The default prints a traceback to stderr; a browser closing its tab mid-response is routine.
        log.debug("dashboard request from %s failed", client_address, exc_info=True)


class RunWebServer:
    """Serves the dashboard of one coordinator's run. start() returns at once; stop() is idempotent."""

    def __init__(self, state: CoordinatorState, metrics: Callable[[], tuple[bytes, str]] | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.state, self.metrics = state, metrics
        self.assets = dashboard_assets()
        if not is_loopback(host):
            log.warning("the dashboard on %s:%d has no authentication: anyone who reaches it sees the run and its "
                        "islands' hostnames", host, port)
        self._server = _Server((host, port), self._handler_class())
        self.host = host
        self.port: int = self._server.server_address[1]
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> RunWebServer:
        with self._lock:
            if self._stopped:
                raise RuntimeError("this dashboard server was stopped; make a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.25},
                                                name="dashboard-http", daemon=True)
                self._thread.start()
                log.info("dashboard on %s", self.url)
        return self

    def stop(self) -> None:
        """Stops serving and closes the port (safe to call twice, or without start())."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._server.shutdown()  # waits for serve_forever to return; only valid while it runs
            thread.join(5.0)
        self._server.server_close()

    def __enter__(self) -> RunWebServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- requests ---------------------------------------------------------------------------

    def _route(self, path: str, query: str) -> tuple[int, bytes, str, dict[str, str]]:
        """(status, body, content type, extra headers) for a GET."""
        if path in ("/", "/index.html"):
            body, kind = self.assets["index.html"]
            return HTTPStatus.OK, body, kind, {"Cache-Control": "no-cache"}
        if path.startswith("/static/"):
            # Looked up by exact name among the files read at start: no path is ever joined, so
            # "../", encoded slashes or absolute paths can only miss.
            asset = self.assets.get(path[len("/static/"):])
            if asset is None:
                return _text(HTTPStatus.NOT_FOUND, "no such file\n")
            return HTTPStatus.OK, asset[0], asset[1], {"Cache-Control": "no-cache"}
        if path == "/api/run":
            try:
                since = int(parse_qs(query).get("since", ["0"])[0])
            except ValueError:
                return _text(HTTPStatus.BAD_REQUEST, "since must be an integer\n")
            body = json.dumps(run_snapshot(self.state, since), allow_nan=False, separators=(",", ":")).encode()
            return HTTPStatus.OK, body, "application/json", {"Cache-Control": "no-store"}
        if path == "/metrics":
            if self.metrics is None:
                return _text(HTTPStatus.NOT_FOUND, "metrics are not enabled on this coordinator\n")
            body, kind = self.metrics()
            return HTTPStatus.OK, body, kind, {"Cache-Control": "no-store"}
        if path == "/healthz":
            return _text(HTTPStatus.OK, "ok\n")
        return _text(HTTPStatus.NOT_FOUND, "not found\n")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        web = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "diloco-coordinator"
            sys_version = ""
            protocol_version = "HTTP/1.1"  # keep-alive: the page polls every 2 s
            timeout = 30  # an idle kept-alive connection's thread ends after this, not at process exit

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._respond(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._respond(head=True)

            def _respond(self, head: bool) -> None:
                url = urlsplit(self.path)
                try:
                    status, body, kind, headers = web._route(url.path, url.query)
                except Exception:  # noqa: BLE001 - one failing request must not take the server down
                    log.exception("dashboard: %s failed", url.path)
                    status, body, kind, headers = _text(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error\n")
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                for name, value in {**SECURITY_HEADERS, **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
                log.debug("dashboard %s: " + format, self.address_string(), *args)

        return Handler


def _text(status: int, text: str) -> tuple[int, bytes, str, dict[str, str]]:
    return status, text.encode(), "text/plain; charset=utf-8", {}
