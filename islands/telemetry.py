"""An island's telemetry: Prometheus metrics, JSON lines, TensorBoard, and what its heartbeats report.

Every rank of every island kind runs the same code (islands/island.py calls
attach with the island's parts, islands/context.py's IslandContext, at the
start of its run, inner_step after every committed inner step, landed after
every boundary step, finish at the end). The accounting always
runs: it is a few additions per inner step, and the heartbeat reports it
(utilization, tokens/s and train loss of the last window). What it writes
(--metrics-port, --log-url, --tensorboard) comes from one rank per replica
group, its rank 0 (`exporting`); the options are the same on every rank, so
every rank takes part in the one collective: at each landing the ranks of a
group add up their connections' bytes (each rank pushes and pulls its own
shard), so the figures are the group's. Push and pull seconds are rank 0's
(the ranks exchange in parallel).

- Metrics (prometheus_client, this process's own CollectorRegistry), served at
  http://HOST:PORT/metrics; PORT is --metrics-port plus the replica group (0:
  any free port, logged and written in the JSON log's start record). Served as
  the coordinator serves its port (diloco/security/httpserve.py): a connection holds no
  thread until its request is whole (closed after METRICS_TIMEOUT_S without
  one), and at most METRICS_HANDLERS requests are answered at once, so clients
  that send half a request and stop neither hold threads nor stop a scrape.
- JSON lines at --log-url, `<name>[-g<group>]-<start>.jsonl`, rotated by size, where
  name is the island id (island-3), or island-<label> with a label
  (diloco/jsonlog.py): a start record (config, metrics address), one record per
  window of inner steps (--log-window, default the round's H) and one per
  landed exchange (round, fragment, push and pull seconds, bytes).
- TensorBoard at --tensorboard/<name>[-g<group>]: the config as text,
  the window's scalars by inner step, the exchange's by round.

MFU: model FLOPs per token 6N + 12 * layers * d_model * seq_len (forward and
backward, attention included), against the GPU's dense bf16 peak (PEAK_FLOPS; on
other devices only with --peak-tflops). It is over the window's wall time, so it
includes waiting; the inner steps' own is MFU / utilization.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from diloco.models.moe import inactive_parameters
from diloco.security.httpserve import HttpServer, text
from diloco.jsonlog import JsonLines, LogError, check_tensorboard, tensorboard_writer

log = logging.getLogger(__name__)

# Dense bf16 peak per GPU, FLOP/s, by a piece of torch.cuda.get_device_name(); the first match wins.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H800", 989e12),
    ("A100", 312e12), ("A800", 312e12),
)
_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, math.inf)


@dataclass
class TelemetryOptions:
    metrics_port: int | None = None  # None: no exporter; 0: any free port; P: P + the replica group
    metrics_host: str = "127.0.0.1"
    log_url: str = ""  # JSON lines (a local folder or s3://bucket/prefix); "": none
    tensorboard_dir: str = ""  # "": none
    window_steps: int = 0  # inner steps per window (a JSON line, tokens/s); 0: the round's H
    label: str = ""  # names the log parts and the TensorBoard folder; "": the island id
    peak_flops: float | None = None  # per device; None: from PEAK_FLOPS by the GPU's name (no MFU if unknown, or CPU)
    flush_s: float = 5.0

    @property
    def writes(self) -> bool:
        return self.metrics_port is not None or bool(self.log_url) or bool(self.tensorboard_dir)


def gpu_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of a CUDA device from PEAK_FLOPS; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS if key.lower() in name.lower()), None)


def flops_per_token(n_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward): 6N for the weights, 12 L d T for attention."""
    return 6.0 * n_params + 12.0 * n_layers * d_model * seq_len


# A scrape takes milliseconds. A connection that has not sent a whole request this long after it opened is closed,
# and no more than METRICS_HANDLERS whole requests are answered at once (diloco/security/httpserve.py: a connection holds no
# thread until its request is whole). 300 half-sent requests once held 300 threads of the island for as long as their
# clients liked, and then, bounded at 16 threads, made the port drop a scrape.
METRICS_TIMEOUT_S = 10.0
METRICS_HANDLERS = 16


class MetricsServer:
    """/metrics of a registry over HTTP, served as the coordinator serves its own port (diloco/security/httpserve.py): a request
    takes a thread only once it is whole, at most METRICS_HANDLERS at once; a connection that sends no whole request
    within METRICS_TIMEOUT_S is closed. stop() shuts it down and frees the port."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        self.registry = registry
        self.server = HttpServer(self._route, host, port, name="metrics", workers=METRICS_HANDLERS,
                                 head_timeout_s=METRICS_TIMEOUT_S, write_timeout_s=METRICS_TIMEOUT_S,
                                 server="diloco-island").start()
        self.host, self.port = host, self.server.port

    def _route(self, path: str, query: str) -> tuple[int, bytes, str, dict[str, str]]:
        if path not in ("/", "/metrics"):
            return text(HTTPStatus.NOT_FOUND, "not found: the metrics are at /metrics\n")
        return HTTPStatus.OK, generate_latest(self.registry), CONTENT_TYPE_LATEST, {"Cache-Control": "no-store"}

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        self.server.stop()


class IslandMetrics:
    """The island's Prometheus metrics, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.info = Gauge("diloco_island_info", "This island (1): its id, replica group and rank", ["island", "group", "rank"], registry=r)
        self.steps = Counter("diloco_inner_steps", "Inner steps committed", registry=r)
        self.tokens = Counter("diloco_inner_tokens", "Tokens trained on (the whole island's)", registry=r)
        self.inner_s = Counter("diloco_inner_seconds", "Seconds in inner steps", registry=r)
        self.wait_s = Counter("diloco_exchange_wait_seconds", "Seconds blocked waiting for exchanges to land", registry=r)
        self.tokens_per_s = Gauge("diloco_inner_tokens_per_second", "Tokens per second over the last window (wall time)", registry=r)
        self.loss = Gauge("diloco_inner_train_loss", "Mean train loss of the last window of inner steps", registry=r)
        self.utilization = Gauge("diloco_inner_utilization", "Share of the last window's wall time in inner steps", registry=r)
        self.mfu: Gauge | None = None  # only where there is a peak to measure against (add_mfu)
        self.round = Gauge("diloco_exchange_round", "The round of the last landed exchange", ["fragment"], registry=r)
        self.seconds = Histogram("diloco_exchange_seconds", "Seconds per exchange's push and pull, and per fetch", ["kind"],
                                 buckets=_SECONDS_BUCKETS, registry=r)
        self.bytes = Counter("diloco_exchange_bytes", "Bytes on the wire (the replica group's connections)", ["direction"], registry=r)

    def add_mfu(self) -> None:
        if self.mfu is None:
            self.mfu = Gauge("diloco_inner_mfu", "Model FLOPs utilization over the last window (wall time)", registry=self.registry)


@dataclass
class _Window:
    started: float
    wait0: float
    steps: int = 0
    tokens: int = 0
    inner_s: float = 0.0
    loss_sum: float = 0.0


@dataclass
class _Calls:
    """One exchange's calls as this rank saw them."""

    push_s: float = 0.0
    pull_s: float = 0.0
    pushes: int = 0
    pulls: int = 0
    up: int = 0
    down: int = 0


class IslandTelemetry:
    """One rank's telemetry. exporting: this rank writes (rank 0 of its replica group); the default
    options write nothing (the heartbeat's report only)."""

    def __init__(self, options: TelemetryOptions | None = None, exporting: bool = True, group: int = 0, groups: int = 1):
        o = self.options = options or TelemetryOptions()
        self.exporting, self.group, self.groups = exporting and o.writes, group, groups
        self.metrics = IslandMetrics() if self.exporting and o.metrics_port is not None else None
        self.server: MetricsServer | None = None
        self.lines: JsonLines | None = None
        self.board = None  # torch.utils.tensorboard.SummaryWriter
        self.ctx = None  # the island's parts (islands/context.py IslandContext), bound at attach
        self.report = {"utilization": 0.0, "tokens_per_s": 0.0, "train_loss": 0.0}
        self._window: _Window | None = None
        self._calls: dict[tuple[int, int], _Calls] = {}
        self._lock = threading.Lock()
        self._landed = 0
        self._sent = [0.0, 0.0]  # the group's bytes up and down counted so far
        if not self.exporting:
            return
        if o.tensorboard_dir:
            check_tensorboard()
        if o.log_url:
            self.lines = JsonLines(o.log_url, "island", o.flush_s)
        if self.metrics is not None:
            port = o.metrics_port + self.group if o.metrics_port else 0
            try:
                self.server = MetricsServer(self.metrics.registry, o.metrics_host, port)
            except OSError as e:
                self.close()
                raise LogError(f"cannot serve metrics on {o.metrics_host}:{port}: {e}; choose another --metrics-port "
                               "(replica group g serves on port + g)") from e
            log.info("island metrics at %s", self.server.url)

    # --- the island's hooks --------------------------------------------------------------------

    def attach(self, ctx) -> None:
        """Binds to the island's parts (its IslandContext) at the start of its run: its config, model size, device,
        connection."""
        if self.ctx is ctx:
            return
        self.ctx, cfg = ctx, ctx.cfg
        ctx.client.on_call = self._on_call
        self.window_steps = self.options.window_steps or cfg.inner.steps_per_round
        self.step_tokens = cfg.inner.batch_size * cfg.data.seq_len  # per rank and inner step
        n_params = ctx.manifest.total_numel()
        active = n_params - inactive_parameters(cfg.model)  # a mixture of experts computes with the routed experts only
        self.flops_per_token = flops_per_token(active, cfg.model.n_layers, cfg.model.d_model, cfg.data.seq_len)
        self.peak = self.options.peak_flops or gpu_peak_flops(ctx.world.device)
        self._window = _Window(time.monotonic(), ctx.timing["wait_s"])
        if not self.exporting:
            return
        name = (f"island-{self.options.label}" if self.options.label else ctx.island_id) + (
            f"-g{self.group}" if self.groups > 1 else "")
        if self.metrics is not None:
            if self.peak:
                self.metrics.add_mfu()
            self.metrics.info.labels(ctx.island_id, str(self.group), str(ctx.world.rank)).set(1)
        if self.options.tensorboard_dir:
            self.board = tensorboard_writer(f"{self.options.tensorboard_dir.rstrip('/')}/{name}", cfg.to_toml(),
                                            flush_s=self.options.flush_s)
        if self.lines is not None:
            self.lines.prefix = name
            self._write({"event": "start", "group": self.group, "rank": ctx.world.rank, "parameters": n_params,
                         "flops_per_token": self.flops_per_token, "peak_flops": self.peak,
                         "metrics": self.server.url if self.server else None, "config": cfg.to_dict()})

    def inner_step(self, loss: float, tokens: int, seconds: float) -> None:
        """After each committed inner step: its loss, the island's tokens, its seconds."""
        w = self._window
        if w is None:
            return
        w.steps += 1
        w.tokens += tokens
        w.inner_s += seconds
        w.loss_sum += loss
        if self.metrics is not None:
            self.metrics.steps.inc()
            self.metrics.tokens.inc(tokens)
            self.metrics.inner_s.inc(seconds)
        if w.steps >= self.window_steps:
            self._close_window()

    def landed(self, ctx) -> None:
        """After each boundary step (every rank of the group): records the exchanges landed since the last call."""
        new = ctx.exchanges[self._landed:]
        self._landed = len(ctx.exchanges)
        for record in new:
            self._record_round(ctx, record)

    def finish(self) -> None:
        """At the end of the run: the last, partial window; everything written so far."""
        if self._window is not None and self._window.steps:
            self._close_window()
        if self.lines is not None:
            self.lines.flush()
        if self.board is not None:
            self.board.flush()

    def heartbeat_report(self) -> dict[str, float]:
        """The heartbeat's utilization, tokens_per_s and train_loss (0 until the first window closes)."""
        return self.report

    def close(self) -> None:
        """Stops the exporter and closes the logs."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.lines is not None:
            self.lines.close()
            self.lines = None
        if self.board is not None:
            self.board.close()
            self.board = None

    # --- inside -------------------------------------------------------------------------------------

    def _on_call(self, kind: str, fragment: int, round_: int, seconds: float, nbytes: int, ok: bool) -> None:
        """A push, pull or fetch call ended (on whatever thread made it)."""
        if kind == "fetch":
            if self.metrics is not None and ok:
                self.metrics.seconds.labels("fetch").observe(seconds)
            return
        with self._lock:
            calls = self._calls.setdefault((fragment, round_), _Calls())
            if kind == "push":
                calls.push_s, calls.pushes, calls.up = calls.push_s + seconds, calls.pushes + 1, calls.up + nbytes
            else:
                calls.pull_s, calls.pulls, calls.down = calls.pull_s + seconds, calls.pulls + 1, calls.down + nbytes

    def _close_window(self) -> None:
        w, ctx, now = self._window, self.ctx, time.monotonic()
        wall = max(now - w.started, 1e-9)
        wait = ctx.timing["wait_s"] - w.wait0
        tokens_per_s = w.tokens / wall
        loss = w.loss_sum / w.steps
        utilization = min(1.0, w.inner_s / wall)
        gpus = w.tokens / (w.steps * self.step_tokens)
        mfu = tokens_per_s * self.flops_per_token / (self.peak * gpus) if self.peak else math.nan
        self.report = {"utilization": utilization, "tokens_per_s": tokens_per_s, "train_loss": loss}
        self._window = _Window(now, ctx.timing["wait_s"])
        if self.metrics is not None:
            m = self.metrics
            m.tokens_per_s.set(tokens_per_s)
            m.loss.set(loss)
            m.utilization.set(utilization)
            m.wait_s.inc(max(0.0, wait))
            if m.mfu is not None:
                m.mfu.set(mfu)
        step = ctx.state.step
        if self.lines is not None:
            self._write({"event": "window", "first_step": step - w.steps, "last_step": step, "steps": w.steps,
                         "tokens": w.tokens, "tokens_per_s": tokens_per_s, "train_loss": loss, "inner_s": w.inner_s,
                         "wait_s": wait, "wall_s": wall, "utilization": utilization, "mfu": mfu})
        if self.board is not None:
            for tag, value in (("tokens_per_s", tokens_per_s), ("train_loss", loss), ("utilization", utilization),
                               ("mfu", mfu), ("wait_s", wait)):
                if math.isfinite(value):
                    self.board.add_scalar(f"inner/{tag}", value, step)

    def _record_round(self, ctx, record: dict) -> None:
        key = (record["fragment"], record["round"])
        with self._lock:
            calls = self._calls.pop(key, _Calls())
            for old in [k for k in self._calls if k[0] == key[0] and k[1] < key[1]]:
                del self._calls[old]  # exchanges that never landed here (resynced past)
        if not self.options.writes:  # the same on every rank of the group
            return
        client = ctx.client
        # Every rank of the group, at the same landing: the group's bytes of this exchange and in all.
        up, down, sent_up, sent_down = ctx.group_reduce([calls.up, calls.down, client.bytes_sent, client.bytes_received])
        grown = (max(0.0, sent_up - self._sent[0]), max(0.0, sent_down - self._sent[1]))
        self._sent = [max(sent_up, self._sent[0]), max(sent_down, self._sent[1])]
        if not self.exporting:
            return
        if self.metrics is not None:
            m = self.metrics
            m.bytes.labels("up").inc(grown[0])
            m.bytes.labels("down").inc(grown[1])
            m.round.labels(str(key[0])).set(key[1])
            if calls.pushes:
                m.seconds.labels("push").observe(calls.push_s)
            if calls.pulls:
                m.seconds.labels("pull").observe(calls.pull_s)
        exchange_s = record["finished_at"] - record["started_at"] if record["finished_at"] else math.nan
        if self.lines is not None:
            self._write({"event": "round", "round": key[1], "fragment": key[0], "pushed_step": record["pushed_step"],
                         "due": record["due"], "push_s": calls.push_s, "pull_s": calls.pull_s, "pushes": calls.pushes,
                         "pulls": calls.pulls, "exchange_s": exchange_s, "bytes_up": int(up), "bytes_down": int(down),
                         "wait_s_total": ctx.timing["wait_s"]})
        if self.board is not None:
            prefix = f"exchange/fragment{key[0]}" if len(ctx.fragments) > 1 else "exchange"
            for tag, value in (("push_s", calls.push_s), ("pull_s", calls.pull_s), ("seconds", exchange_s),
                               ("bytes_up", up), ("bytes_down", down)):
                if math.isfinite(value):
                    self.board.add_scalar(f"{prefix}/{tag}", value, key[1])

    def _write(self, record: dict) -> None:
        ctx = self.ctx
        self.lines.write({"time": round(time.time(), 3), "island": ctx.island_id if ctx is not None else "", **record})
