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
from diloco.security.untrusted import HOSTNAME_MAX, ID_MAX, KEY_MAX, bounded

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
    # The process that is the island now (the token its calls name, INSTANCE_KEY; "" when its joins named none) and
    # the address it joined from. A join naming another process replaces this one: its token is retired (the most
    # recent RETIRED_KEPT kept) and each of its calls is refused REPLACED, naming where and when the new one joined.
    instance: str = ""
    peer: str = ""
    retired: list = field(default_factory=list)
    replaced_from: str = ""  # where the process that replaced the one before joined from
    replaced_at: float = 0.0  # and when (Unix time)
    # Its place in the canonical order (Membership.order): when it was first admitted, the N of island-N (-1: not known).
    seq: int = -1


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
    islands_replaced: int = 0  # a process joined as an island another live process was; that one was told to stop
    island_silent_s: float = 0.0  # those islands' silence before they came back: last heartbeat to rejoin
    revoked: int = 0  # islands removed because their credential was revoked
    idle_removed: int = 0  # islands removed after limits.idle_rounds rounds without a contribution
    refusals: dict = field(default_factory=dict)  # reason name -> calls refused with it


RETIRED_KEPT = 16  # replaced process tokens an island remembers (each refused REPLACED, its joins too)
ATTACH_WAIT_S = 30.0  # the longest a replacing join waits for the old process's whole pushes to be kept or refused


def where(hostname: str, peer: str) -> str:
    """Where a process joined from, for people: the hostname it gave and the address it called from."""
    return f"{hostname} ({peer})" if peer and peer != hostname else hostname


def canonical_order(island_ids) -> list[str]:
    """Island ids in natural order ("island-2" before "island-10"): admission order for the ids of a run without
    certificates. Membership.order is the run's canonical order, which holds for names too."""
    return sorted(island_ids, key=_natural)


def _natural(island_id: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", island_id)]


def admission_of(island_id: str) -> int:
    """N of an id island-N (what a run without certificates names its N-th island), else -1."""
    match = re.fullmatch(r"island-(\d+)", island_id)
    return int(match[1]) if match else -1


class Membership:
    def __init__(self, max_islands: int, shards: int, lease_s: float, cond: threading.Condition,
                 clock: Callable[[], float], on_leave: Callable[[str], None] = lambda island_id: None,
                 revoked: Callable[[str], bool] = lambda owner: False, record: Callable[..., None] = lambda event, **f: None,
                 idle_rounds: int = 0, departed_kept: int = LimitsConfig.departed_kept,
                 on_replace: Callable[[str], None] = lambda island_id: None):
        self.max_islands, self.shards, self.lease_s = max_islands, shards, lease_s
        self.idle_rounds = idle_rounds  # fragment rounds without a contribution before removal (0: never)
        self.departed_kept = departed_kept  # records of departed islands kept, and of expired ones
        self.cond, self.clock = cond, clock
        self.on_leave = on_leave  # drops the island's half-pushed contributions; called holding cond
        # Another process became the island: drops what the old one half-pushed (its leases stay); called holding cond.
        self.on_replace = on_replace
        self.attaching: dict[str, int] = {}  # island id -> its whole pushes being kept now (begin_attach)
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

    def order(self, island_ids) -> list[str]:
        """Island ids in the run's canonical order, the order contributions are folded in and leases granted: the
        order the islands were first admitted (island-0, island-1, ... without certificates; named ones as they
        came), so that which island reads which data and where its contribution falls in a sum do not depend on
        which of them joined first. Ids of no record here go last, in natural order. Caller holds cond."""
        seq = {i.island_id: i.seq for i in (*self.departed, *self.expired.values(), *self.islands.values())}
        return sorted(island_ids, key=lambda i: (0, seq[i], []) if seq.get(i, -1) >= 0 else (1, 0, _natural(i)))

    # --- the process that is an island -----------------------------------------------------

    def check_instance(self, island_id: str, instance: str) -> None:
        """Refuses a call from a process that is no longer the island (another joined as it since): REPLACED. A call
        that names no process (instance "") is not checked; nor is one for an island not known here."""
        if not instance or not island_id:
            return
        with self.cond:
            island = self.islands.get(island_id) or self.expired.get(island_id) or self._departed(island_id)
            if island is None:
                return
            if instance != island.instance and instance not in island.retired:
                # A process never seen here joined after the checkpoint this coordinator restarted from (or the island
                # joined naming none): it is the island now, as its join would have made it.
                if island.instance:
                    island.retired = [*island.retired, island.instance][-RETIRED_KEPT:]
                island.instance = instance
            if instance != island.instance:
                raise Refused(Reason.REPLACED, _replaced_message(island))

    def superseded(self, island_id: str, instance: str) -> bool:
        """Whether the process `instance` has been replaced as island_id (a waiting pull gives up then)."""
        try:
            self.check_instance(island_id, instance)
        except Refused:
            return True
        return False

    def begin_attach(self, island_id: str, instance: str) -> None:
        """A push of island_id arrived whole: refused REPLACED if its process was replaced meanwhile, else counted
        until end_attach, so that a join replacing its process waits until it is kept (or not) before dropping what the
        old process half-pushed: no part of an old process's push is folded once a new one is the island."""
        with self.cond:
            self.check_instance(island_id, instance)
            self.attaching[island_id] = self.attaching.get(island_id, 0) + 1

    def end_attach(self, island_id: str) -> None:
        with self.cond:
            left = self.attaching.get(island_id, 0) - 1
            if left > 0:
                self.attaching[island_id] = left
            else:
                self.attaching.pop(island_id, None)
            self.cond.notify_all()

    def _take_over(self, island: Island, instance: str, hostname: str, peer: str) -> str:
        """A join of `instance` as island: where the process it replaces joined from ("" when it replaces none: the
        same process, or a join naming none). A process replaced before is refused. Caller holds cond."""
        if not instance:
            return ""
        if instance in island.retired:
            raise Refused(Reason.REPLACED, _replaced_message(island))
        if island.instance in ("", instance):
            island.instance, island.peer = instance, island.peer if island.instance else peer
            return ""
        old = where(island.hostname, island.peer)
        island.retired = [*island.retired, island.instance][-RETIRED_KEPT:]
        island.instance, island.peer = instance, peer
        island.replaced_from, island.replaced_at = where(hostname, peer), time.time()
        return old

    def _wait_for_attaching(self, island_id: str, key: str, instance: str) -> None:
        """A join that will replace a live process first lets that process's whole pushes be kept or refused
        (begin_attach), at most ATTACH_WAIT_S. Caller holds cond."""
        island = self.islands.get(island_id) or next((i for i in self.islands.values() if key and i.key == key), None)
        if island is None or not instance or island.instance in ("", instance) or instance in island.retired:
            return
        self.cond.wait_for(lambda: not self.attaching.get(island.island_id), ATTACH_WAIT_S)

    # --- joining and leaving --------------------------------------------------------------

    def join(self, hostname: str, island_id: str = "", key: str = "", run_finished: bool = False, round_: int = 0,
             owner: str | None = None, ranks: int = 1, assigned: bool = False, instance: str = "", peer: str = "",
             replaced: list[str] | None = None) -> Island:
        """Admits an island; a known island_id rejoins as itself, a known key gets its island (another replica group).
        assigned: island_id is the one the leading shard gave it (a following shard, docs/sharding.md), not ours to pick.

        With an owner (mutual TLS: the client certificate's name) the owner is the key, so the replica groups of
        one credential are one island, named as the certificate is, and only the owner may rejoin as an island it
        made. ranks: what the island declares it trains on (the most its pushes may claim tokens for), bounded by
        the caller (the service: the credential's certificate, or rounds.max_island_ranks). hostname and key are
        the client's word: kept and logged bounded (diloco/security/untrusted.py).

        instance: the process joining (its calls' INSTANCE_KEY; "": not said), peer: its address. A join of another
        process than the one the island is replaces it (appended to `replaced`: where that one joined from); a
        process replaced before is refused REPLACED."""
        hostname, key = bounded(hostname, HOSTNAME_MAX), bounded(key, KEY_MAX)
        instance, peer = bounded(instance, ID_MAX), bounded(peer, HOSTNAME_MAX)
        island = self._admit(hostname, island_id, key, run_finished, round_, owner, assigned, instance, peer,
                             replaced if replaced is not None else [])
        with self.cond:
            island.ranks = max(1, ranks)
        return island

    def _admit(self, hostname: str, island_id: str, key: str, run_finished: bool, round_: int, owner: str | None,
               assigned: bool = False, instance: str = "", peer: str = "", replaced: list[str] | None = None) -> Island:
        if owner is not None:
            self.check_owner(island_id, owner)
            key = f"owner:{owner}"
        with self.cond:
            if run_finished:
                raise Refused(Reason.RUN_FINISHED, "the run has finished; nothing to join")
            self._wait_for_attaching(island_id, key, instance)
            self.expire_leases()
            away = self._away(island_id, key)
            if away is not None:
                self._take_over(away, instance, hostname, peer)  # a process it was is out, live or not
                return self._come_back(away, hostname, round_)
            explicit_id = bool(island_id) and island_id in self.islands
            if key and not explicit_id:
                island_id = next((i.island_id for i in self.islands.values() if i.key == key), island_id)
            if island_id and island_id in self.islands:
                island = self.islands[island_id]
                old = self._take_over(island, instance, hostname, peer)
                if explicit_id:  # a restarted island presenting its own id, not another replica group by key
                    self.events.island_restarts += 1
                    self.events.island_silent_s += self.clock() - island.last_seen
                island.last_seen = self.clock()
                if old:
                    self._replaced(island, old, hostname, peer, replaced)
                else:
                    log.info("%s rejoined from %s at round %d", island_id, hostname, round_)
                return island
            if len(self.islands) >= self.max_islands:
                raise Refused(Reason.RUN_FULL, f"run is full: {len(self.islands)} islands (rounds.max_islands={self.max_islands})")
            # Without mutual TLS an island is named by its admission; with it, as its certificate is (unless a record of
            # another credential holds that name: one a run made before islands were named so, restored).
            name = island_id if assigned else owner or f"island-{self.joined}"
            if not assigned and owner and self._holds_name(name):
                name = f"island-{self.joined}"
            # Its place in the canonical order: its admission here; on a following shard the leading shard's (island-N),
            # else its admission here (islands join the leader, then each shard in turn).
            seq = admission_of(name) if assigned and admission_of(name) >= 0 else self.joined
            island = Island(name, hostname, self.joined % self.shards, self.clock(), key=key, owner=owner or "",
                            joined_at=self.clock(), instance=instance, peer=peer, seq=seq)
            self.joined += 1
            self.islands[island.island_id] = island
            log.info("%s joined from %s at round %d (shard %d)", island.island_id, hostname, round_, island.shard)
            self.cond.notify_all()
            return island

    def _replaced(self, island: Island, old: str, hostname: str, peer: str, replaced: list[str]) -> None:
        """Another process joined as a live island: one line; what the old one half-pushed goes; the old one's waits
        end (its calls are refused REPLACED from now on). Caller holds cond."""
        new = where(hostname, peer)
        log.warning("%s: a new process joined (from %s); the one from %s is replaced", island.island_id, new, old)
        self.events.islands_replaced += 1
        self.record("replaced", island=island.island_id, joined_from=new, replaced=old)
        island.hostname = hostname
        self.on_replace(island.island_id)
        replaced.append(old)
        self.cond.notify_all()

    def _holds_name(self, island_id: str) -> bool:
        """Whether a record (a member, expired, departed) holds this id. Caller holds cond."""
        return island_id in self.islands or island_id in self.expired or self._departed(island_id) is not None

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
                         "ranks": i.ranks, "probation": i.probation, "idle": i.idle, "contributed": i.contributed,
                         "instance": i.instance, "peer": i.peer, "retired": list(i.retired),
                         "replaced_from": i.replaced_from, "replaced_at": i.replaced_at, "seq": i.seq}
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
                                                   contributed=i.get("contributed", False),
                                                   instance=bounded(i.get("instance", ""), ID_MAX), peer=i.get("peer", ""),
                                                   retired=list(i.get("retired", []))[-RETIRED_KEPT:],
                                                   replaced_from=i.get("replaced_from", ""),
                                                   replaced_at=i.get("replaced_at", 0.0),
                                                   seq=i.get("seq", admission_of(i["island_id"]))) for i in state["islands"]}
            # An older checkpoint may hold every departed island and unbounded strings: bounded as they come back.
            self.departed = [_bounded_record(i) for i in state["departed"]]
            self.expired = {i["island_id"]: _bounded_record(i) for i in state.get("expired", [])}
            self._keep_bounded()
            self.events = Events(**state["events"])
            self.events.restarts += 1


def _replaced_message(island: Island) -> str:
    """What a replaced process is told (its one line): which island, where and when the new process joined."""
    if not island.replaced_at:
        return f"another process is {island.island_id} now; this one stops"
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(island.replaced_at))
    return f"another process joined as {island.island_id} from {island.replaced_from} at {at}; this one stops"


def _bounded_record(fields: dict) -> Island:
    """A departed or expired island's record from a checkpoint, its client-given strings bounded."""
    island = Island(**fields)
    island.hostname, island.key = bounded(island.hostname, HOSTNAME_MAX), bounded(island.key, KEY_MAX)
    if "seq" not in fields:  # a checkpoint from before islands had a place of their own: island-N's
        island.seq = admission_of(island.island_id)
    return island
