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
    rounds_done: int = 0  # fragment 0's rounds landed here
    resyncs: int = 0

    def __post_init__(self) -> None:
        p = len(self.rounds)
        self.checksums = self.checksums or [""] * p
        self.last_sync = self.last_sync or [self.step] * p
        self.loss = self.loss or [[0.0, 0] for _ in range(p)]
        self.tokens = self.tokens or [0] * p

    @property
    def round(self) -> int:
        """Fragment 0's round (the island's round without streaming)."""
        return self.rounds[0]

    def done(self) -> bool:
        return self.finished or all(r >= self.stop_round for r in self.rounds)

    def restart_fragment(self, f: int) -> None:
        """Fragment f's round begins now (after a landing or a resync)."""
        self.last_sync[f], self.loss[f], self.tokens[f] = self.step, [0.0, 0], 0

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)
