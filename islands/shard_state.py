"""What a rank of a sharded island carries besides its model shard: its place, its position, its residual."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from diloco.codec import subtract_residual_
from islands.fsdp import ShardLayout
from islands.replicas import FtConfig


@dataclass
class ReplicaSpec:
    """Where this rank sits in its island and how the groups find each other."""

    group: int = 0
    groups: int = 1
    key: str = ""  # the island key all groups join under
    ft: FtConfig = field(default_factory=FtConfig)
    report_dir: str = ""  # per-rank JSON reports and final shards (tests, debugging)
    measure_memory: bool = False
    receive_window_bytes: int = 0  # see islands.client.channel_options


@dataclass
class Position:
    """Where the island stands; part of what a healing group receives."""

    island_id: str
    round: int
    stop_round: int  # leave once this round is reached (--max-rounds)
    pos: int = 0  # inner steps committed in this round; H means the exchange is due
    tokens: int = 0
    loss_sum: float = 0.0  # of the per-step loss averaged across the groups
    checksum: str = ""  # the coordinator's checksum of the global parameters we hold
    ranges_checksum: str = ""  # and of our ranges of them
    finished: bool = False
    rounds_done: int = 0


class ShardFeedback:
    """Error feedback for a lossy uplink, per shard. Encoding never consumes state:
    it writes the new residual to `pending`, which becomes the state only once the
    exchange committed. So a resent or taken-over push encodes the same bytes."""

    def __init__(self, layout: ShardLayout, decay: float, in_model: bool = False):
        self.decay = decay
        self.in_model = in_model  # the residual stays in the local shard (see diloco.codec.ErrorFeedback)
        self.committed = layout.zeros()
        self.pending = layout.zeros()

    def encode(self, name: str, lo: int, hi: int, piece: torch.Tensor, codec) -> bytes:
        residual = piece.clone() if self.in_model else self.committed[name][lo:hi] * self.decay + piece
        payload = codec.encode(residual)
        self.pending[name][lo:hi].copy_(residual - codec.decode(payload, hi - lo))
        return payload

    def commit(self) -> None:
        for name, t in self.committed.items():
            t.copy_(self.pending[name])

    def reset(self) -> None:
        for t in self.committed.values():
            t.zero_()

    def keep_residual_(self, local: dict[str, torch.Tensor]) -> None:
        """local -= decay * committed residual (in_model, right after local was set to theta_global)."""
        subtract_residual_(local, self.committed, self.decay)
