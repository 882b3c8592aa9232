"""The run as plain JSON-ready data, for the live dashboard (coordinator/web.py) and anyone polling it.

run_snapshot() holds the state's condition only long enough to copy what may change
(the summaries list's tail, the islands' fields); turning summaries into dicts
happens outside it, since a summary is never changed once appended. Per-island
totals (bytes, tokens) are kept in a per-state cache that folds in only the
summaries appended since the last call, so a poll costs O(new rounds + islands)
however long the run: the dashboard polls every ~2 s for the whole run. The
cache is its poller's (RunTotals: the dashboard server keeps one); without one
the totals are summed afresh.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from coordinator.membership import Island, canonical_order
from coordinator.state import CoordinatorState
from diloco.v1 import diloco_pb2 as pb

__all__ = ["RunTotals", "run_snapshot", "round_dict"]


def _num(x: float) -> float | None:
    """JSON has no NaN or infinity: an unknown number is null."""
    return x if math.isfinite(x) else None


@dataclass
class _Totals:
    """Running sums over state.summaries[:seen]."""

    summaries_id: int = 0  # id() of the list folded: a restore replaces the list, and the sums start again
    seen: int = 0
    up: dict[str, int] = field(default_factory=dict)
    down: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)  # each island's last contribution's train loss
    ddp_bytes: float = 0.0
    bytes_total: int = 0

    def stale(self, summaries: list[pb.RoundSummary]) -> bool:
        """Whether these sums are of another list (a coordinator restore replaces it) or of a longer one."""
        return id(summaries) != self.summaries_id or len(summaries) < self.seen

    def fold(self, summaries: list[pb.RoundSummary]) -> None:
        """Adds the summaries not folded yet. Caller holds the state's cond (the list and this cache)."""
        for s in summaries[self.seen:]:
            for t in s.traffic:
                self.up[t.island_id] = self.up.get(t.island_id, 0) + t.bytes_up
                self.down[t.island_id] = self.down.get(t.island_id, 0) + t.bytes_down
            for c in s.contributions:
                self.tokens[c.island_id] = self.tokens.get(c.island_id, 0) + c.tokens
                if math.isfinite(c.train_loss):
                    self.loss[c.island_id] = c.train_loss
            self.ddp_bytes += s.ddp_bytes
            self.bytes_total += s.bytes_up + s.bytes_down
        self.seen = len(summaries)


class RunTotals:
    """One poller's running per-island totals (_Totals), started again when the state's summaries list is replaced
    (a restore). Used under the state's cond."""

    def __init__(self) -> None:
        self.totals = _Totals()

    def fold(self, summaries: list[pb.RoundSummary]) -> _Totals:
        if self.totals.stale(summaries):
            self.totals = _Totals(summaries_id=id(summaries))
        self.totals.fold(summaries)
        return self.totals


def round_dict(index: int, s: pb.RoundSummary) -> dict:
    """One round summary as JSON-ready data; index is its position in state.summaries."""
    return {
        "index": index,
        "round": s.round,
        "fragment": s.fragment,
        "islands": list(s.islands),
        "tokens": s.tokens,
        "train_loss": _num(s.train_loss),
        "eval_loss": _num(s.eval_loss),
        "bytes_up": s.bytes_up,
        "bytes_down": s.bytes_down,
        "ddp_bytes": s.ddp_bytes,
        "seconds": _num(s.seconds),
        "wait_s": _num(s.wait_s),
        "fold_s": _num(s.fold_s),
        "step_s": _num(s.step_s),
        "publish_s": _num(s.publish_s),
        "eval_s": _num(s.eval_s),
        "closed_at": _num(s.closed_at) or None,  # 0: a summary restored from an older checkpoint
        "clipped": list(s.clipped),
        "dropped": list(s.dropped),
        "contributions": [{"island_id": c.island_id, "tokens": c.tokens, "train_loss": _num(c.train_loss)}
                          for c in s.contributions],
        "traffic": {t.island_id: [t.bytes_up, t.bytes_down] for t in s.traffic},
        "task_scores": {k: _num(v) for k, v in s.task_scores.items()},
    }


@dataclass
class _IslandCopy:
    """What the snapshot needs of an Island, copied under cond (the Island object keeps changing)."""

    island_id: str
    status: str
    hostname: str
    ranks: int
    last_seen: float
    last_push: float
    report: dict

    @classmethod
    def of(cls, island: Island, status: str) -> _IslandCopy:
        # A heartbeat without a report arrives as zeros (proto3 has no "unset" for a double): all zero is no report.
        report = dict(island.report) if any(island.report.values()) else {}
        return cls(island.island_id, status, island.hostname, island.ranks, island.last_seen, island.last_push, report)


def _report_value(report: dict, key: str) -> float | None:
    value = report.get(key)
    return _num(float(value)) if isinstance(value, (int, float)) else None


def run_snapshot(state: CoordinatorState, since_round_index: int = 0, totals: RunTotals | None = None) -> dict:
    """The run now, with the round summaries from position since_round_index on (see the module doc); totals: the
    poller's running totals (None: summed afresh)."""
    since = max(0, since_round_index)
    cfg = state.cfg
    # The whole-model checksum may take the fragments' read locks: never under cond (state.checksum's rule).
    checksum = state.checksum
    with state.cond:
        members = state.members
        now_mono = state.clock()
        copies: dict[str, _IslandCopy] = {}
        # Later sources win: an island that left and came back as itself is listed by where it is now.
        for island in members.departed:
            copies[island.island_id] = _IslandCopy.of(island, "departed")
        for island in members.expired.values():
            copies[island.island_id] = _IslandCopy.of(island, "expired")
        for island in members.islands.values():
            copies[island.island_id] = _IslandCopy.of(island, "probation" if island.probation else "live")
        totals = (totals or RunTotals()).fold(state.summaries)
        up, down, tokens, loss = dict(totals.up), dict(totals.down), dict(totals.tokens), dict(totals.loss)
        ddp_bytes, bytes_total = totals.ddp_bytes, totals.bytes_total
        new = state.summaries[since:]  # a copy of the list's tail; the summaries in it do not change
        count = len(state.summaries)
        events = dataclasses.asdict(members.events)
        fragment_rounds = [f.round for f in state.fragments]
        finished = state.finished
        codec, downlink = state.codec.name, state.publication.codec.name
    islands = []
    for island_id in canonical_order(copies):
        c = copies[island_id]
        reported_loss = _report_value(c.report, "train_loss")
        reported_loss = reported_loss if reported_loss else None  # 0: not reported (a cross-entropy is never 0)
        islands.append({
            "island_id": island_id,
            "status": c.status,
            "hostname": c.hostname,
            "ranks": c.ranks,
            # Only a member's lease is running; a departed or expired island's age would mean nothing.
            "lease_age_s": max(0.0, now_mono - c.last_seen) if c.status in ("live", "probation") else None,
            "last_push": c.last_push or None,
            "bytes_up": up.get(island_id, 0),
            "bytes_down": down.get(island_id, 0),
            "tokens": tokens.get(island_id, 0),
            "train_loss": reported_loss if reported_loss is not None else loss.get(island_id),
            "utilization": _report_value(c.report, "utilization"),
            "tokens_per_s": _report_value(c.report, "tokens_per_s"),
        })
    return {
        "run": {
            "name": cfg.name, "codec": codec, "downlink_codec": downlink, "fragments": len(fragment_rounds),
            "total_rounds": cfg.rounds.rounds, "islands_min": cfg.rounds.min_islands, "islands_max": cfg.rounds.max_islands,
            "inner_steps": cfg.inner.steps_per_round,
        },
        "round": min(fragment_rounds),
        "finished": finished,
        "initial_eval_loss": _num(state.initial_eval_loss),
        "checksum": checksum,
        # Unix time of this snapshot: the page measures "last push N s ago" against it, not the browser's clock.
        "now": time.time(),
        # Where the next poll starts (since=next_since); smaller than the page's count after a coordinator restore.
        "next_since": count,
        "rounds": [round_dict(since + i, s) for i, s in enumerate(new)],
        "islands": islands,
        "events": events,
        "traffic_factor": ddp_bytes / bytes_total if bytes_total else None,
        "bytes_total": bytes_total,
        "shards": shard_rows(state),
    }


def shard_rows(state: CoordinatorState) -> list[dict]:
    """A sharded coordinator's leader: a row per shard (its round and the bytes it carried), the leader's first;
    empty for a coordinator of one process."""
    if state.followers is None:
        return []
    with state.cond:
        leader_round = min(f.round for f in state.fragments)
    return state.followers.rows(leader_round)
