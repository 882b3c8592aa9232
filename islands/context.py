"""What the parts of one island rank share: the one object the loop, its round, its checkpoint and its telemetry hold.

The loop (islands/island.py) builds it once; the round (islands/round.py
IslandRound), the checkpoint (islands/checkpoint.py) and the telemetry
(islands/telemetry.py) are handed it and read what they need of it, so none of
them holds the island itself and none passes the others' references around.
`FragmentShard` is this rank's part of one fragment of the model (or of all of
it): the views of theta_local and theta_global an exchange reads and writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diloco.config import RunConfig
from diloco.fragments import FragmentLayout
from diloco.inner import build_inner_optimizer
from diloco.streaming import EagerState
from diloco.wire.feedback import ErrorFeedback
from diloco.wire.messages import FlatRange, Manifest
from islands.client import CoordinatorClient
from islands.evidence import NO_FAULTS, Evidence, Faults
from islands.replicas import ReplicaGroups
from islands.state import IslandState, ReplicaSpec
from islands.world import IslandWorld


@dataclass
class FragmentShard:
    """This rank's part of one fragment (or of the whole model): its ranges, and views of theta_local and theta_global there."""

    index: int
    manifest: Manifest  # the fragment's parameters, full shapes
    ranges: list[FlatRange]  # this rank's ranges of them
    whole: bool  # the rank holds all of it (a one-rank island): results come without ranges
    local: dict[str, torch.Tensor]  # flat views of the model's parameters (writes go to the model)
    global_: dict[str, torch.Tensor]  # theta_global: shaped like the parameters when whole, flat otherwise

    @property
    def wire_ranges(self) -> list[FlatRange] | None:
        return None if self.whole else self.ranges

    def numel(self) -> int:
        return sum(r.numel for r in self.ranges)

    def flat_global(self, name: str) -> torch.Tensor:
        return self.global_[name].view(-1)

    @property
    def flat(self) -> dict[str, torch.Tensor]:
        """theta_global as flat views, shaped like the local views."""
        return {n: t.view(-1) for n, t in self.global_.items()}

    def part(self, index: int, names: tuple[str, ...]) -> "FragmentShard":
        """This rank's part of the fragment of these parameters (views of the same tensors)."""
        return FragmentShard(
            index, Manifest({n: self.manifest.shapes[n] for n in names}), [r for r in self.ranges if r.name in names],
            self.whole, {n: self.local[n] for n in names}, {n: self.global_[n] for n in names},
        )


def _timing() -> dict[str, float]:
    return {"compute_s": 0.0, "wait_s": 0.0, "straggler_s": 0.0, "wall_s": 0.0}


@dataclass
class IslandContext:
    """One rank's island: its settings, its place, its connection, its position, its model and what it exchanges."""

    cfg: RunConfig
    spec: ReplicaSpec
    world: IslandWorld
    client: CoordinatorClient
    state: IslandState  # the island's position: what the round advances, a checkpoint writes, a healing group receives
    layout: FragmentLayout  # the fragments' fixed schedule
    total_rounds: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # replaced by a fresh one when our training diverged (reset_training)
    params: FragmentShard  # this rank's part of the whole model: the initial fetch, a rewind, the finish
    fragments: list[FragmentShard]  # this rank's part of each fragment: its exchange, landing and resync
    replicas: ReplicaGroups  # the replica groups, and what the ranks agree on
    feedback: ErrorFeedback | None = None  # error feedback (one residual per parameter shard)
    eager: list[EagerState] | None = None  # eager updates' memory, one per fragment
    leased: bool = False  # trains on leased samples (a token corpus): hands back those it did not train at leave
    evidence: Evidence = field(default_factory=lambda: Evidence("", 0, 0))
    faults: Faults = NO_FAULTS  # DILOCO_FAULT's points (islands/evidence.py)
    timing: dict[str, float] = field(default_factory=_timing)  # inner steps; blocked on results (of which on others' pushes); all
    exchanges: list[dict] = field(default_factory=list)  # one record per landed exchange
    restored: bool = False  # loaded from a checkpoint (islands/checkpoint.py restore)
    cores: object | None = None  # islands.cores.CoreShare: on the CPU without --threads, re-shared every round

    @property
    def island_id(self) -> str:
        return self.state.island_id

    @property
    def manifest(self) -> Manifest:
        return self.params.manifest

    @property
    def global_shard(self) -> dict[str, torch.Tensor]:
        """This rank's theta_global (fp32, on the CPU): shaped like the parameters when whole, flat otherwise."""
        return self.params.global_

    @property
    def local(self) -> dict[str, torch.Tensor]:
        return self.params.local

    def group_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """An all-reduce of a few numbers over the group's ranks."""
        return self.world.reduce(values, op)

    def reset_training(self) -> None:
        """Our training diverged (a push refused as not finite): a fresh inner optimizer and error feedback."""
        self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
        if self.feedback is not None:
            self.feedback.reset()
