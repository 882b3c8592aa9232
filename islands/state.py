"""What an island rank carries besides its model shard: its place in the island and where it stands.

IslandState is the one position object of every island kind: a checkpoint
writes it, a healing replica group receives it, and the loop advances it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from islands.replicas import FtConfig


@dataclass
class ReplicaSpec:
    """Where this rank sits in its island and how the groups find each other (one group, one rank: the defaults)."""

    group: int = 0
    groups: int = 1
    key: str = ""  # the island key all groups join under
    ft: FtConfig = field(default_factory=FtConfig)
    report_dir: str = ""  # per-rank JSON reports and final shards (tests, debugging)
    measure_memory: bool = False
    receive_window_bytes: int = 0  # see islands.client.channel_options
    # This island's own H (0: the run's inner.steps_per_round), islands/round.py's RoundPace; the same on every rank.
    steps_per_round: int = 0
    # Seconds slept in every inner step, as if on a slower device (tests and benchmarks of unequal islands).
    throttle_s: float = 0.0
    # torch threads on the CPU (--threads); 0: this rank's share of the machine's cores, with the other ranks
    # training on it (islands/cores.py).
    cpu_threads: int = 0


@dataclass
class IslandState:
    """Where the island stands, per fragment of the model (one fragment without streaming)."""

    island_id: str
    rounds: list[int]  # each fragment's current round: the one being trained for
    stop_round: int  # leave once every fragment has reached this round (--max-rounds, or the run's end)
    checksums: list[str] = field(default_factory=list)  # the coordinator's checksum of each fragment we hold
    step: int = 0  # inner steps committed, counted across the whole run
    last_sync: list[int] = field(default_factory=list)  # step at which each fragment's current round began here
    loss: list[list[float]] = field(default_factory=list)  # [sum, count] of the inner losses since then
    tokens: list[int] = field(default_factory=list)  # tokens trained since then (the push's weight)
    finished: bool = False  # the coordinator said the run is over
    # Compression per link: the codec each fragment pushes with, as the coordinator last advised ("": the run's).
    # Part of the position so that every replica group (and a healed one) encodes, and moves its error feedback, alike.
    codecs: list[str] = field(default_factory=list)
    rounds_done: int = 0  # fragment 0's rounds landed here
    resyncs: int = 0
    # Token corpus (islands/feed.py): the leased sample positions held, as [start, stop) pieces in
    # training order. Samples are consumed through a virtual position that runs across the pieces:
    # pieces[0] starts at data_base, data_cursor is where the next inner step reads, and data_marks
    # is the cursor at each fragment's last sync (the push names the positions in between).
    pieces: list[list[int]] = field(default_factory=list)
    leases_taken: int = 0
    leases_forgotten: int = 0  # times the island dropped its leases: tells a refusal of samples dropped already
    data_base: int = 0
    data_cursor: int = 0
    data_marks: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = len(self.rounds)
        self.checksums = self.checksums or [""] * p
        self.last_sync = self.last_sync or [self.step] * p
        self.loss = self.loss or [[0.0, 0] for _ in range(p)]
        self.tokens = self.tokens or [0] * p
        self.codecs = self.codecs or [""] * p
        self.data_marks = self.data_marks or [self.data_cursor] * p

    @property
    def round(self) -> int:
        """Fragment 0's round (the island's round without streaming)."""
        return self.rounds[0]

    def done(self) -> bool:
        return self.finished or all(r >= self.stop_round for r in self.rounds)

    def restart_fragment(self, f: int) -> None:
        """Fragment f's round begins now (after a landing or a resync)."""
        self.last_sync[f], self.loss[f], self.tokens[f] = self.step, [0.0, 0], 0
        self.data_marks[f] = self.data_cursor

    # --- the data position on a token corpus ---------------------------------------------------------

    @property
    def data_end(self) -> int:
        """The virtual position after the last leased piece."""
        return self.data_base + sum(b - a for a, b in self.pieces)

    def add_lease(self, ranges: list[tuple[int, int]]) -> None:
        self.pieces.extend([a, b] for a, b in ranges)
        self.leases_taken += 1

    def positions(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The sample positions of virtual positions [lo, hi), as ranges in order."""
        out, v = [], self.data_base
        for a, b in self.pieces:
            n = b - a
            s, e = max(lo, v), min(hi, v + n)
            if s < e:
                out.append((a + s - v, a + e - v))
            v += n
        return out

    def consume(self, n: int) -> None:
        """A committed inner step read n samples; pieces nobody will name again are dropped."""
        self.data_cursor += n
        keep = min([self.data_cursor, *self.data_marks])
        while self.pieces and self.data_base + self.pieces[0][1] - self.pieces[0][0] <= keep:
            a, b = self.pieces.pop(0)
            self.data_base += b - a

    def untrained(self) -> list[tuple[int, int]]:
        """Leased positions no inner step read: handed back at leave."""
        return self.positions(self.data_cursor, self.data_end)

    def forget_leases(self, named_at: int) -> bool:
        """The coordinator refused samples we named as not ours (it restarted from an older checkpoint) or folded
        already (we resumed from an older checkpoint of our own): drop every lease and take new ones. Each fragment's
        claim restarts with its samples: its next push names only what it trains from here, so it claims only
        their tokens (the steps trained before stay in its pseudo-gradient, unweighted, rather than the whole push
        being refused). named_at: the leases_forgotten of the refused push's samples; False (nothing dropped) for
        a push that named samples dropped already, or the leases taken since would be dropped with them."""
        if named_at != self.leases_forgotten:
            return False
        self.pieces, self.data_base = [], self.data_cursor
        self.data_marks = [self.data_cursor] * len(self.data_marks)
        self.tokens = [0] * len(self.tokens)
        self.leases_forgotten += 1
        return True

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
