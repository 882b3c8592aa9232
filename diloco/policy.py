"""The coordinator's guards, as config sections: robust aggregation ([robust]) and limits ([limits]).

Neither enters the config digest: they are the coordinator's business, and an
island never needs to agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RobustConfig:
    """Robust aggregation (diloco/robust.py): the coordinator's guard against outlier pseudo-gradients."""

    enabled: bool = True
    # A push may claim at most inner_steps x batch x seq_len x the ranks its island declared at join, in
    # whole steps, and at most steps_per_round (+ streaming overlap) inner steps.
    check_claims: bool = True
    # A contribution whose norm exceeds norm_factor x the reference (median of the round's other
    # contributions and of the last `history` rounds) is clipped to the reference norm, or dropped.
    norm_factor: float = 3.0
    action: str = "clip"  # "clip" or "drop"
    history: int = 10
    # Direction: a contribution whose cosine with a strict majority of the round's others is below
    # direction_cosine is dropped (rounds of three or more; estimated from sketches made at intake).
    direction_check: bool = True
    direction_cosine: float = -0.1
    # Until the guard has a reference (no round judged yet), a round closes only with this many contributions:
    # a lone first push has nothing to be judged against. A run of one island sets 1 (diloco-sim does).
    first_quorum: int = 2


@dataclass
class LimitsConfig:
    """What one island may take of a coordinator (coordinator/limits.py), each refused with its own reason."""

    # Push streams an island may have open at once: this many per declared rank, plus 2 (a rank's push
    # and its retry overlapping a cancelled one). Beyond: TOO_MANY_STREAMS.
    push_streams_per_rank: int = 2
    # A push stream that sends nothing for this long is cut off and what it sent dropped: STREAM_IDLE.
    push_idle_s: float = 60.0
    # A push stream must arrive at least this fast, in Mbit/s of its own, after push_idle_s of grace (only the time
    # the coordinator waits on it counts): one that trickles a chunk just inside push_idle_s would otherwise hold its
    # round to rounds.deadline_s. Beyond: STREAM_IDLE. 1 Mbit/s per stream is a 64-rank island behind a 0.1 Gbit/s
    # link; lower it for more ranks behind a slower one. 0: no floor.
    push_floor_mbps: float = 1.0
    # A coordinator of several shards: once the leading shard closed a round with an island's contribution, a
    # following shard waits this long for that island's push to begin there (islands push to every shard at once);
    # one that does not begin is dropped on every shard (a contribution is whole on all or none), and is not waited
    # for again until it pushes there.
    shard_push_start_s: float = 10.0
    # Once every other island a round waits for is in, a push still arriving is waited for only while its own pace
    # (elements since its first chunk) says it is whole within this many times the median time the others' pushes
    # took, plus push_idle_s (coordinator/stragglers.py): a member pushing just above push_floor_mbps would otherwise
    # hold a large model's round for hours. A slower link is brought back to pace by wire.link_codecs, or folded
    # late (rounds.late_rounds). 0: waited for up to rounds.deadline_s.
    push_pace_factor: float = 4.0
    # Heartbeats an island may send per rounds.heartbeat_s, per declared rank (bursts of twice that):
    # islands send one. Beyond: RATE_LIMITED.
    heartbeats_per_interval: float = 4.0
    # Joins one credential may make a minute (bursts of as many): RATE_LIMITED. Mutual TLS only: without
    # it there is no credential to count by.
    joins_per_minute: float = 30.0
    # An island that was a member through this many rounds in a row and contributed to none is removed
    # from the run; when its credential joins again it is on probation: no round waits for it until it
    # has contributed. 0: never removed. The count follows the island's credential (mutual TLS) through a leave
    # and a rejoin, and a credential that rejoins without having contributed since its last join, or after
    # sitting through a round idle, is on probation at once: leaving and rejoining resets nothing.
    idle_rounds: int = 3
    # Samples an island may hold leased ahead of its training (token corpus, coordinator/ledger.py LeaseBound): this
    # many rounds of what its ranks train in a round (inner.batch_size x ranks x the most inner steps a round holds),
    # each closed round giving one round's back. A lease is at most one round's. Beyond: RATE_LIMITED.
    lease_rounds: int = 4
    # Records of islands that left or whose lease ran out, kept for the run's report, the dashboard and the
    # checkpoint (with mutual TLS each credential has one, which carries its idle count and probation): the
    # most recent this many; older ones are forgotten. A client's strings in them are bounded (diloco/security/untrusted.py).
    departed_kept: int = 256
    # Disk the spooled pushes may use, all islands together; a chunk beyond it: SPOOL_FULL.
    spool_gb: float = 64.0
    # Memory the spooled pushes use before they go to disk, all islands together, in fp32 copies of the model
    # (coordinator/spool.py): kept once allocated, so the coordinator's memory stays a few models whatever the
    # number of islands. 0: every push waits on disk.
    spool_memory_models: float = 1.0
    # What the transport may buffer for each incoming stream before the coordinator reads it, in MiB (its HTTP/2
    # receive window). gRPC otherwise grows the window by probing the link, and on a coordinator whose cores are
    # busy folding it grows towards whole pushes: memory that scales with the islands pushing at once. A stream
    # carries at most window / round-trip time: 32 MiB is 2.7 Gbit/s at 100 ms (each rank pushes on a stream of
    # its own). Raise it for faster, longer links; 0: gRPC's probing, unbounded.
    receive_window_mb: float = 32.0
    # Push streams the coordinator reads at once, all islands together (coordinator/limits.py PushSlots). A push
    # beyond waits, its island sending nothing but its header until admitted, so what the transport buffers for
    # pushes is at most push_slots x receive_window_mb (1 GiB) whatever the number of islands and ranks. No island
    # holds more than max(1, push_slots // members) at once. 32 keeps 8 islands at 4 streams each, which fill a
    # 10 Gbit/s link at 100 ms; 0: no bound (every stream is read as it opens).
    push_slots: int = 32
    # Round watches (WatchRounds) one credential may hold open at once, and all callers together: each holds one
    # of the coordinator's server threads while it lasts, so the total stays well under the threads kept beyond
    # the islands' own (coordinator/server.py). Beyond either: TOO_MANY_STREAMS. Without mutual TLS only the
    # total holds (there is no credential to count by).
    watch_streams_per_credential: int = 2
    watch_streams: int = 8

    def valid(self) -> bool:
        if min(self.watch_streams_per_credential, self.watch_streams) <= 0:
            return False
        return (min(self.push_streams_per_rank, self.push_idle_s, self.heartbeats_per_interval, self.joins_per_minute,
                    self.spool_gb, self.departed_kept, self.lease_rounds) > 0 and self.idle_rounds >= 0 and self.spool_memory_models >= 0
                and self.receive_window_mb >= 0 and self.push_slots >= 0 and self.push_floor_mbps >= 0)
