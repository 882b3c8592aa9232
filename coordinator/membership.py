"""Who takes part in the run: islands, their leases, and the failures seen along the way.

Shared by every fragment's round machine through a narrow seam (touch, live,
is_member, events): a fragment never reaches into the coordinator's state.
All methods that read or change membership expect the caller to hold `cond`,
except join, touch and leave, which take it themselves.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco.wire.refusal import Reason, Refused
from diloco.policy import LimitsConfig
from diloco.security.untrusted import HOSTNAME_MAX, KEY_MAX, bounded

log = logging.getLogger(__name__)


@dataclass
class Island:
    island_id: str
    hostname: str
    shard: int
    last_seen: float
    final_checksum: str = ""
    # The replica groups of one island join under one key (empty: a one-group island).
    key: str = ""
    # What the island reported when it left: compute_s, wait_s, wall_s, inner_steps.
    stats: dict = field(default_factory=dict)
    # With mutual TLS, the name on the client certificate that made it: only that credential may act as it.
    owner: str = ""
    ranks: int = 1  # as declared at join: replica groups x ranks per group
    joined_at: float = 0.0  # when it (re)joined: rounds opened before then do not count it idle
    idle: int = 0  # rounds in a row that closed while it was a member, without a contribution of its
    # Removed once for idleness, or back without a contribution since it last joined: no round waits for it
    # until it contributes.
    probation: bool = False
    contributed: bool = False  # to a round closed since it last (re)joined
    last_push: float = 0.0  # Unix time its last contribution became whole (0: none yet)
    # What it last reported in a heartbeat: utilization, tokens_per_s, train_loss (metrics, dashboard).
    report: dict = field(default_factory=dict)


@dataclass
class Events:
    """Failures seen during the run, for the end-of-run summary."""

    leases_expired: int = 0
    dropped_nonfinite: int = 0
    checksum_resyncs: int = 0
    late_pushes: int = 0  # refused: too late (more than rounds.late_rounds)
    late_folded: int = 0  # folded into a later round with their staleness discount (rounds.late_rounds)
    restarts: int = 0  # of the coordinator
    rounds_lost: int = 0
    recovery_s: float = 0.0  # coordinator restarts: from restore to the first round closed again
    island_restarts: int = 0  # an island came back under its own id (e.g. `join --resume`), a member still or expired
    island_silent_s: float = 0.0  # those islands' silence before they came back: last heartbeat to rejoin
    revoked: int = 0  # islands removed because their credential was revoked
    idle_removed: int = 0  # islands removed after limits.idle_rounds rounds without a contribution
    refusals: dict = field(default_factory=dict)  # reason name -> calls refused with it


def canonical_order(island_ids) -> list[str]:
    """Island ids in admission order ("island-2" before "island-10"): the order contributions are folded in."""
    return sorted(island_ids, key=lambda i: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", i)])


class Membership:
    def __init__(self, max_islands: int, shards: int, lease_s: float, cond: threading.Condition,
                 clock: Callable[[], float], on_leave: Callable[[str], None] = lambda island_id: None,
                 revoked: Callable[[str], bool] = lambda owner: False, record: Callable[..., None] = lambda event, **f: None,
                 idle_rounds: int = 0, departed_kept: int = LimitsConfig.departed_kept):
        self.max_islands, self.shards, self.lease_s = max_islands, shards, lease_s
        self.idle_rounds = idle_rounds  # fragment rounds without a contribution before removal (0: never)
        self.departed_kept = departed_kept  # records of departed islands kept, and of expired ones
        self.cond, self.clock = cond, clock
        self.on_leave = on_leave  # drops the island's half-pushed contributions; called holding cond
        self.revoked = revoked  # whether an owner's credential is revoked (mutual TLS)
        self.record = record  # the audit log
        self.islands: dict[str, Island] = {}
        self.departed: list[Island] = []
        self.expired: dict[str, Island] = {}  # islands whose lease ran out: a restarted one may come back as itself
        self.joined = 0
        self.events = Events()

    # --- the seam the round machines use ---------------------------------------------------

    def touch(self, island_id: str, report: dict | None = None) -> Island:
        with self.cond:
            island = self.islands.get(island_id)
            if island is None:
                raise Refused(Reason.NOT_A_MEMBER, f"unknown island {island_id!r} (lease expired?); join again")
            island.last_seen = self.clock()
            if report:
                island.report = report
            return island

    def pushed(self, island_id: str) -> None:
        """The island's contribution to a round became whole. Caller holds cond."""
        if island_id in self.islands:
            self.islands[island_id].last_push = time.time()

    def live(self) -> list[str]:
        """The members whose lease holds, after removing those whose lease ran out. Caller holds cond."""
        self.expire_leases()
        return list(self.islands)

    def is_member(self, island_id: str) -> bool:
        return island_id in self.islands

    def is_known(self, island_id: str) -> bool:
        """A member, or an island whose lease ran out or that left (it may come back as itself)."""
        with self.cond:
            return island_id in self.islands or island_id in self.expired or self._departed(island_id) is not None

    def waited_for(self) -> list[str]:
        """The live members a round waits for: all but those on probation. Caller holds cond."""
        return [i for i in self.live() if not self.islands[i].probation]

    def after_round(self, opened_at: float, contributors: list[str]) -> None:
        """A round closed: counts who sat through it without contributing; removes the idle. Caller holds cond.

        An island that joins and never pushes would otherwise hold every round
        to its deadline and keep its place in the run for as long as it heartbeats."""
        for island_id, island in list(self.islands.items()):
            if island_id in contributors:
                island.idle, island.probation, island.contributed = 0, False, True
            elif island.joined_at <= opened_at:
                island.idle += 1
                if self.idle_rounds and island.idle >= self.idle_rounds:
                    log.warning("%s sat through %d rounds without contributing; removed from the run (on probation if it "
                                "comes back)", island_id, island.idle)
                    self.events.idle_removed += 1
                    self.record("idle", island=island_id, rounds=island.idle)
                    island.idle, island.probation = 0, True
                    self.expired[island_id] = self.islands.pop(island_id)
                    self.on_leave(island_id)
        self._keep_bounded()

    def check_owner(self, island_id: str, owner: str | None) -> None:
        """Refuses a caller acting as an island its credential did not make (owner None: no TLS, no check)."""
        if owner is None:
            return
        if self.revoked(owner):
            raise Refused(Reason.REVOKED, f"the credential {owner!r} was revoked; it is out of the run")
        with self.cond:
            island = self.islands.get(island_id) or self.expired.get(island_id) or self._departed(island_id)
        if island is not None and island.owner != owner:
            log.warning("%r tried to act as %s, which belongs to %r; refused", owner, island_id, island.owner)
            raise Refused(Reason.NOT_YOURS, f"{island_id} is not yours: it belongs to another credential")

    # --- joining and leaving --------------------------------------------------------------

    def join(self, hostname: str, island_id: str = "", key: str = "", run_finished: bool = False, round_: int = 0,
             owner: str | None = None, ranks: int = 1, assigned: bool = False) -> Island:
        """Admits an island; a known island_id rejoins as itself, a known key gets its island (another replica group).
        assigned: island_id is the one the leading shard gave it (a following shard, docs/sharding.md), not ours to pick.

        With an owner (mutual TLS: the client certificate's name) the owner is the key, so the replica groups of
        one credential are one island, and only the owner may rejoin as an island it made. ranks: what the
        island declares it trains on (the most its pushes may claim tokens for), bounded by the caller (the
        service: the credential's certificate, or rounds.max_island_ranks). hostname and key are the client's
        word: kept and logged bounded (diloco/security/untrusted.py)."""
        hostname, key = bounded(hostname, HOSTNAME_MAX), bounded(key, KEY_MAX)
        island = self._admit(hostname, island_id, key, run_finished, round_, owner, assigned)
        with self.cond:
            island.ranks = max(1, ranks)
        return island

    def _admit(self, hostname: str, island_id: str, key: str, run_finished: bool, round_: int, owner: str | None,
               assigned: bool = False) -> Island:
        if owner is not None:
            self.check_owner(island_id, owner)
            key = f"owner:{owner}"
        with self.cond:
            if run_finished:
                raise Refused(Reason.RUN_FINISHED, "the run has finished; nothing to join")
            self.expire_leases()
            away = self._away(island_id, key)
            if away is not None:
                return self._come_back(away, hostname, round_)
            explicit_id = bool(island_id) and island_id in self.islands
            if key and not explicit_id:
                island_id = next((i.island_id for i in self.islands.values() if i.key == key), island_id)
            if island_id and island_id in self.islands:
                island = self.islands[island_id]
                if explicit_id:  # a restarted island presenting its own id, not another replica group by key
                    self.events.island_restarts += 1
                    self.events.island_silent_s += self.clock() - island.last_seen
                island.last_seen = self.clock()
                log.info("%s rejoined from %s at round %d", island_id, hostname, round_)
                return island
            if len(self.islands) >= self.max_islands:
                raise Refused(Reason.RUN_FULL, f"run is full: {len(self.islands)} islands (rounds.max_islands={self.max_islands})")
            island = Island(island_id if assigned else f"island-{self.joined}", hostname, self.joined % self.shards, self.clock(), key=key, owner=owner or "",
                            joined_at=self.clock())
            self.joined += 1
            self.islands[island.island_id] = island
            log.info("%s joined from %s at round %d (shard %d)", island.island_id, hostname, round_, island.shard)
            self.cond.notify_all()
            return island

    def _departed(self, island_id: str) -> Island | None:
        return next((i for i in reversed(self.departed) if i.island_id == island_id), None)

    def _away(self, island_id: str, key: str) -> Island | None:
        """The record of an island not in the run now that comes back as itself: by its id after its lease ran out
        (a restart that took long), or by its credential (a credential has one island, even expired or departed,
        so its idle count and probation follow it through a leave and a rejoin). Caller holds cond."""
        if island_id in self.islands:
            return None
        if key.startswith("owner:") and not any(i.key == key for i in self.islands.values()):
            mine = [i for i in self.expired.values() if i.key == key] + [i for i in reversed(self.departed) if i.key == key]
            if mine:
                return mine[0]
        return self.expired.get(island_id)

    def _come_back(self, island: Island, hostname: str, round_: int) -> Island:
        """Makes an expired or departed island a member again. One that has not contributed since it last joined
        (and left), or that sat through a round idle, is on probation: leaving and rejoining resets nothing, and
        no round waits for it until it contributes. Caller holds cond."""
        now, left = self.clock(), any(i is island for i in self.departed)
        if left:
            self.departed = [i for i in self.departed if i is not island]
            how = "after it had left"
        else:
            del self.expired[island.island_id]
            self.events.island_restarts += 1
            self.events.island_silent_s += now - island.last_seen
            how = "after its lease had run out"
        if not island.probation and (island.idle > 0 or left and not island.contributed):
            island.probation = True
            log.warning("%s rejoined without contributing since it last joined (%d idle round(s)); on probation: no "
                        "round waits for it until it contributes", island.island_id, island.idle)
            self.record("probation", island=island.island_id, idle=island.idle)
        island.hostname, island.contributed = hostname, False
        island.last_seen = island.joined_at = now
        self.islands[island.island_id] = island
        log.info("%s rejoined from %s at round %d %s", island.island_id, hostname, round_, how)
        return island

    def _keep_bounded(self) -> None:
        """Forgets the oldest records of departed and expired islands past limits.departed_kept. Caller holds cond."""
        del self.departed[: max(0, len(self.departed) - self.departed_kept)]
        while len(self.expired) > self.departed_kept:
            del self.expired[next(iter(self.expired))]  # the oldest: a dict keeps insertion order

    def leave(self, island_id: str, final_checksum: str, stats: dict | None, matches: bool) -> None:
        with self.cond:
            island = self.islands.pop(island_id, None)
            if island is not None:
                island.final_checksum = final_checksum
                island.stats = dict(stats or {})
                self.departed.append(island)
                self._keep_bounded()
                log.info("%s left; checksum %s", island_id, "matches" if matches else "DIFFERS")
                self.on_leave(island_id)
            self.cond.notify_all()

    def expire_leases(self) -> None:
        """Removes islands whose lease ran out (and their half-pushed contributions). Caller holds cond."""
        now = self.clock()
        for island_id, island in list(self.islands.items()):
            if island.owner and self.revoked(island.owner):
                log.warning("%s: the credential %r was revoked; removed from the run", island_id, island.owner)
                self.events.revoked += 1
                self.record("revoked", island=island_id, credential=island.owner)
                del self.islands[island_id]
                self.on_leave(island_id)
            elif now - island.last_seen > self.lease_s:
                log.warning("%s missed its %.1fs lease; removed from the run", island_id, self.lease_s)
                self.events.leases_expired += 1
                self.record("expired", island=island_id, lease_s=self.lease_s)
                self.expired[island_id] = self.islands.pop(island_id)
                self.on_leave(island_id)
        self._keep_bounded()

    # --- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "joined": self.joined,
            "islands": [{"island_id": i.island_id, "hostname": i.hostname, "shard": i.shard, "key": i.key, "owner": i.owner,
                         "ranks": i.ranks, "probation": i.probation, "idle": i.idle, "contributed": i.contributed}
                        for i in self.islands.values()],
            "departed": [dataclasses.asdict(i) for i in self.departed],
            "expired": [dataclasses.asdict(i) for i in self.expired.values()],
            "events": dataclasses.asdict(self.events),
        }

    def load_state_dict(self, state: dict) -> None:
        """Members get a fresh lease (they are reconnecting now); counts a coordinator restart."""
        with self.cond:
            now = self.clock()
            self.joined = state["joined"]
            self.islands = {i["island_id"]: Island(i["island_id"], i["hostname"], i["shard"], now, key=i.get("key", ""),
                                                   owner=i.get("owner", ""), ranks=i.get("ranks", 1), joined_at=now,
                                                   probation=i.get("probation", False), idle=i.get("idle", 0),
                                                   contributed=i.get("contributed", False)) for i in state["islands"]}
            # An older checkpoint may hold every departed island and unbounded strings: bounded as they come back.
            self.departed = [_bounded_record(i) for i in state["departed"]]
            self.expired = {i["island_id"]: _bounded_record(i) for i in state.get("expired", [])}
            self._keep_bounded()
            self.events = Events(**state["events"])
            self.events.restarts += 1


def _bounded_record(fields: dict) -> Island:
    """A departed or expired island's record from a checkpoint, its client-given strings bounded."""
    island = Island(**fields)
    island.hostname, island.key = bounded(island.hostname, HOSTNAME_MAX), bounded(island.key, KEY_MAX)
    return island
