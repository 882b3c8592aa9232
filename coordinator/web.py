"""The coordinator's own HTTP port: the live dashboard, its JSON API, and the metrics.

diloco/security/httpserve.py's server (the one an island's --metrics-port uses too), on threads
of its own apart from the gRPC server, so a slow browser never holds a thread islands
need, and connections that send half a request hold none of its. Routes:

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
from importlib import resources
from urllib.parse import parse_qs

from coordinator.snapshot import RunTotals, run_snapshot
from coordinator.state import CoordinatorState
from diloco.security.httpserve import HttpServer
from diloco.security.httpserve import text as _text
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


class RunWebServer:
    """Serves the dashboard of one coordinator's run. start() returns at once; stop() is idempotent."""

    def __init__(self, state: CoordinatorState, metrics: Callable[[], tuple[bytes, str]] | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.state, self.metrics = state, metrics
        self.totals = RunTotals()  # the dashboard's running per-island totals (coordinator/snapshot.py)
        self.assets = dashboard_assets()
        if not is_loopback(host):
            log.warning("the dashboard on %s:%d has no authentication: anyone who reaches it sees the run and its "
                        "islands' hostnames", host, port)
        self._server = HttpServer(self._route, host, port, name="dashboard", headers=SECURITY_HEADERS,
                                  server="diloco-coordinator")
        self.host = host
        self.port: int = self._server.port
        self._started = False
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
            if not self._started:
                self._started = True
                self._server.start()
                log.info("dashboard on %s", self.url)
        return self

    def stop(self) -> None:
        """Stops serving and closes the port (safe to call twice, or without start())."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.stop()

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
            body = json.dumps(run_snapshot(self.state, since, self.totals), allow_nan=False, separators=(",", ":")).encode()
            return HTTPStatus.OK, body, "application/json", {"Cache-Control": "no-store"}
        if path == "/metrics":
            if self.metrics is None:
                return _text(HTTPStatus.NOT_FOUND, "metrics are not enabled on this coordinator\n")
            body, kind = self.metrics()
            return HTTPStatus.OK, body, kind, {"Cache-Control": "no-store"}
        if path == "/healthz":
            return _text(HTTPStatus.OK, "ok\n")
        return _text(HTTPStatus.NOT_FOUND, "not found\n")
