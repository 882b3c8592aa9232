"""The coordinator's Prometheus metrics, read from its state when scraped.

A collector rather than counters bumped along the hot path: rounds, pushes and
heartbeats pay nothing, and a scrape costs one pass over the round summaries
closed since the last one (running totals are kept here). The registry is this
coordinator's own, never prometheus_client's global one.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from coordinator.snapshot import shard_rows

PHASES = ("wait", "fold", "step", "publish", "eval")


@dataclasses.dataclass
class CheckpointStats:
    """The coordinator's checkpoint writes: how many, how long the last took, how many failed."""

    written: int = 0
    failed: int = 0
    last_s: float = math.nan
    total_s: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, seconds: float, ok: bool) -> None:
        with self._lock:
            self.written += ok
            self.failed += not ok
            self.last_s = seconds
            self.total_s += seconds


class _Totals:
    """Running sums over the summaries folded so far."""

    def __init__(self) -> None:
        self.seen = 0
        self.closed: dict[int, int] = defaultdict(int)  # fragment -> rounds closed
        self.bytes_up: dict[str, int] = defaultdict(int)
        self.bytes_down: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.loss: dict[str, float] = {}
        self.phase_s: dict[str, float] = defaultdict(float)
        self.last_phase_s: dict[str, float] = {}
        self.ddp_bytes = 0.0
        self.sent = 0
        self.eval_loss = self.train_loss = math.nan
        self.clipped = 0

    def fold(self, summaries) -> None:
        for s in summaries[self.seen:]:
            self.closed[s.fragment] += 1
            for t in s.traffic:
                self.bytes_up[t.island_id] += t.bytes_up
                self.bytes_down[t.island_id] += t.bytes_down
            for c in s.contributions:
                self.tokens[c.island_id] += c.tokens
                self.loss[c.island_id] = c.train_loss
            for phase in PHASES:
                seconds = getattr(s, f"{phase}_s")
                self.phase_s[phase] += seconds
                self.last_phase_s[phase] = seconds
            self.ddp_bytes += s.ddp_bytes
            self.sent += s.bytes_up + s.bytes_down
            self.train_loss = s.train_loss
            if not math.isnan(s.eval_loss):
                self.eval_loss = s.eval_loss
            self.clipped += len(s.clipped)
        self.seen = len(summaries)


class CoordinatorCollector:
    def __init__(self, state, checkpoints: CheckpointStats | None = None):
        self.state = state
        self.checkpoints = checkpoints or CheckpointStats()
        self._totals = _Totals()
        self._lock = threading.Lock()  # two scrapes at once fold the same summaries once

    def collect(self):
        state = self.state
        with self._lock, state.cond:
            self._totals.fold(state.summaries)
            totals = self._totals
            rounds = [(f.index, f.round) for f in state.fragments]
            members = state.members
            islands = [(i.island_id, i.probation, i.last_push, dict(i.report)) for i in members.islands.values()]
            joined, departed, expired = members.joined, len(members.departed), len(members.expired)
            events = dataclasses.asdict(members.events)
        yield _gauge("diloco_round", "The round each fragment is in", ["fragment"], [((str(f),), r) for f, r in rounds])
        shards = shard_rows(state)  # a sharded coordinator's leader: the run as one above, each shard here
        if shards:
            yield _gauge("diloco_shard_round", "The round each coordinator shard is in (its slowest fragment's)", ["shard"],
                         [((str(r["shard"]),), r["round"]) for r in shards if r["round"] is not None])
            yield _counter("diloco_shard_bytes", "Bytes each coordinator shard carried", ["shard", "direction"],
                           [((str(r["shard"]), d), r[f"bytes_{d}"]) for r in shards for d in ("up", "down")])
        yield _counter("diloco_rounds_closed", "Rounds closed", ["fragment"],
                       [((str(f),), totals.closed.get(f, 0)) for f, _ in rounds])
        yield _gauge("diloco_islands", "Islands in the run now", ["status"],
                     [(("live",), sum(not p for _, p, _, _ in islands)), (("probation",), sum(p for _, p, _, _ in islands)),
                      (("expired",), expired), (("departed",), departed)])
        yield _counter("diloco_islands_joined", "Islands admitted over the run", [], [((), joined)])
        yield _counter("diloco_island_bytes_up", "Pseudo-gradient bytes received from the island", ["island"],
                       [((i,), n) for i, n in totals.bytes_up.items()])
        yield _counter("diloco_island_bytes_down", "Parameter bytes sent to the island", ["island"],
                       [((i,), n) for i, n in totals.bytes_down.items()])
        yield _counter("diloco_island_tokens", "Tokens the island contributed to folded rounds", ["island"],
                       [((i,), n) for i, n in totals.tokens.items()])
        yield _gauge("diloco_island_train_loss", "The island's train loss in its last folded contribution", ["island"],
                     [((i,), v) for i, v in totals.loss.items()])
        yield _gauge("diloco_island_last_push_timestamp_seconds", "Unix time the island's last contribution became whole",
                     ["island"], [((i,), t) for i, _, t, _ in islands if t])
        for key, help_text in (("utilization", "Share of the island's wall time in inner steps (its heartbeat)"),
                               ("tokens_per_s", "The island's training throughput (its heartbeat)")):
            name = "diloco_island_" + ("tokens_per_second" if key == "tokens_per_s" else key)
            yield _gauge(name, help_text, ["island"], [((i,), r[key]) for i, _, _, r in islands if key in r])
        yield _counter("diloco_round_phase_seconds", "Round time by phase, summed over rounds", ["phase"],
                       [((p,), totals.phase_s.get(p, 0.0)) for p in PHASES])
        yield _gauge("diloco_last_round_phase_seconds", "The last closed round's time by phase", ["phase"],
                     [((p,), totals.last_phase_s[p]) for p in PHASES if p in totals.last_phase_s])
        yield _gauge("diloco_eval_loss", "Eval loss of the global parameters, last evaluated", [],
                     [((), totals.eval_loss)] if not math.isnan(totals.eval_loss) else [])
        yield _gauge("diloco_train_loss", "Token-weighted train loss of the last closed round", [],
                     [((), totals.train_loss)] if not math.isnan(totals.train_loss) else [])
        yield _counter("diloco_bytes", "Bytes on the wire, both directions", [], [((), totals.sent)])
        yield _gauge("diloco_communication_factor", "Bytes a data-parallel ring all-reduce would have sent, per byte sent",
                     [], [((), totals.ddp_bytes / totals.sent)] if totals.sent else [])
        yield _counter("diloco_refusals", "Calls refused, by typed reason", ["reason"],
                       [((r,), n) for r, n in events.pop("refusals").items()])
        yield _counter("diloco_clipped", "Contributions the norm guard clipped", [], [((), totals.clipped)])
        yield _counter("diloco_events", "Failures and recoveries seen (resyncs, leases expired, restarts...)", ["event"],
                       [((k,), v) for k, v in events.items()])
        # Outside cond: counting memory takes no lock (coordinator/memory.py).
        memory, peaks, pool = state.memory(), state.memory_peaks.report(), state.memory_pool()
        yield _gauge("diloco_coordinator_memory_bytes", "Bytes each long-lived part of the coordinator holds now",
                     ["component"], [((k,), v) for k, v in memory.items()])
        yield _gauge("diloco_coordinator_memory_peak_bytes", "The most each part of the coordinator held, sampled "
                     "around each round's close", ["component"], [((k,), v) for k, v in peaks["peak"].items()])
        yield _gauge("diloco_coordinator_memory_at_peak_bytes", "Each part of the coordinator at the sample where all "
                     "of them together held the most", ["component"], [((k,), v) for k, v in peaks["at_peak_total"].items()])
        yield _gauge("diloco_coordinator_spool_pool_bytes", "The spool's memory pool: allocated, held by spools now, "
                     "and its bound", ["kind"], [((k,), v) for k, v in pool.items()])
        yield _gauge("diloco_push_slots", "Push streams read now (held), waiting for a slot, and the bound (limits.push_slots)",
                     ["kind"], [((k,), v) for k, v in state.push_slots.status().items()])
        c = self.checkpoints
        yield _counter("diloco_checkpoints", "Checkpoints written", [], [((), c.written)])
        yield _counter("diloco_checkpoint_failures", "Checkpoint writes that failed", [], [((), c.failed)])
        yield _counter("diloco_checkpoint_seconds", "Time spent writing checkpoints", [], [((), c.total_s)])
        if not math.isnan(c.last_s):
            yield _gauge("diloco_last_checkpoint_seconds", "How long the last checkpoint write took", [], [((), c.last_s)])
        yield _gauge("diloco_scrape_timestamp_seconds", "When these figures were read", [], [((), time.time())])


def _gauge(name: str, help_text: str, labels: list[str], samples) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labels)
    for values, v in samples:
        family.add_metric(list(values), float(v))
    return family


def _counter(name: str, help_text: str, labels: list[str], samples) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=labels)
    for values, v in samples:
        family.add_metric(list(values), float(v))
    return family


def coordinator_metrics(state, checkpoints: CheckpointStats | None = None):
    """A function giving the exposition (bytes, content type) of this coordinator's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(state, checkpoints))
    return lambda: (generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4)
