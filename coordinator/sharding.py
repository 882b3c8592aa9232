"""This process's place in a coordinator of several shards (docs/sharding.md): its index, every shard's address,
the secret the shards share; and the parameters it holds.

Each shard learns its index and the count the way the field launches multi-process
jobs: `--shard I` given by hand, or from the launcher's environment (torchrun's
RANK and WORLD_SIZE, SLURM's SLURM_PROCID and SLURM_NTASKS, a Kubernetes
StatefulSet pod's ordinal at the end of its hostname); `diloco-coordinator serve
--shards K` starts K local shards itself. No cluster manager of our own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from coordinator.gather import FollowerRounds, WholeModel
from coordinator.judging import ShardJudging
from coordinator.limits import max_message_bytes
from coordinator.rollback import RollBack
from diloco.config import RunConfig
from diloco.fragments import layout_for
from diloco.models.llama import initial_parameters, parameter_shapes
from diloco.security.credentials import TlsFiles
from diloco.shardmap import ShardMap, common_step, shard_url, signed, ticket
from diloco.wire.messages import Manifest


@dataclass(frozen=True)
class ShardRole:
    index: int
    addresses: tuple[str, ...]  # every shard's host:port as islands reach it, in shard order
    secret: bytes  # signs the leader's join tickets (never on the wire)

    @property
    def count(self) -> int:
        return len(self.addresses)

    @property
    def leads(self) -> bool:
        return self.index == 0

    def ticket(self, island_id: str, owner: str | None, ranks: int) -> str:
        return ticket(self.secret, island_id, owner or "", ranks)

    def admits(self, presented: str, island_id: str, owner: str | None, ranks: int) -> bool:
        return signed(self.secret, presented, island_id, owner or "", ranks)

    def checkpoint_url(self, base: str) -> str:
        """Where this shard checkpoints its part: a folder of its own under the run's checkpoint.url."""
        return shard_url(base, self.index, self.count)

    def own_url(self, base: str) -> str:
        """Where this shard writes under a location every shard is given (checkpoints, round log, audit log,
        TensorBoard): a folder of its own, shard-I-of-K, so that shards started together overwrite nothing of each
        other's; "" (none) stays ""."""
        return self.checkpoint_url(base) if base else base

    def common_step(self, base: str, keep_last: int) -> int | None:
        """The newest checkpoint step every shard committed (diloco/shardmap.py)."""
        return common_step(base, self.count, keep_last)

    def part(self, cfg: RunConfig) -> tuple[dict, list[Manifest]]:
        """CoordinatorState's arguments for this shard: the parameters it holds (only those are ever made), their
        fragments (every fragment, with its part of the names), and the whole model's manifest and layout (what
        joining islands are told); and every shard's manifest, in shard order."""
        manifest = Manifest(parameter_shapes(cfg.model))
        layout = layout_for(manifest.shapes, cfg)
        shard_map = ShardMap.of(layout, {n: manifest.numel(n) for n in manifest.shapes}, self.count)
        mine = set(shard_map.names(self.index))
        manifests = [Manifest({n: manifest.shapes[n] for n in shard_map.names(i)}) for i in range(self.count)]
        return {"params": initial_parameters(cfg.model, cfg.seed, mine.__contains__),
                "layout": shard_map.restrict(layout, self.index), "model": (manifest, layout)}, manifests


@dataclass
class ShardServices:
    """What a shard of several runs beside its round machines: its part in judging each round (coordinator/judging.py)
    and, on the leader, the other shards' rounds in its summaries and their values for its evaluation
    (coordinator/gather.py)."""

    judging: ShardJudging
    followers: FollowerRounds | None = None
    gathering: WholeModel | None = None
    rollback: RollBack = field(default_factory=RollBack)  # every shard back to their common checkpoint (coordinator/rollback.py)

    @staticmethod
    def start(shard: ShardRole, cfg: RunConfig, tls: TlsFiles | None, manifests: list[Manifest], fragments) -> ShardServices:
        """fragments(): the state's round machines once it exists."""
        services = ShardServices(ShardJudging(shard.index, shard.addresses, shard.secret, tls, cfg.rounds.deadline_s, fragments,
                                                max_message_bytes(cfg)))
        if shard.leads:
            notices = services.judging.notices

            def decided(f: int, r: int) -> bool:
                return r < fragments()[f].round or notices.sent(f, r)

            def apart(why: str) -> None:
                notices.roll_back(why)
                services.rollback.request(why)

            services.followers = FollowerRounds(shard.addresses, shard.secret, tls, decided=decided, apart=apart)
            services.gathering = WholeModel(shard.addresses, shard.secret, tls, manifests[1:])
        return services

    def restored(self) -> None:
        """The state is restored: the leader watches its followers from now (it compares their rounds with its own)."""
        if self.followers is not None:
            self.followers.start()

    def state_args(self) -> dict:
        """CoordinatorState's arguments for a shard: the round machines' judge and sketch keys, the leader's followers,
        and whether its rounds follow the leader's closes."""
        return {"judge": self.judging, "sketch_secret": self.judging.sketch_secret, "followers": self.followers,
                "follows_leader": self.judging.follower is not None}

    def evaluators(self, evaluate, tasks, initial, fragments) -> dict:
        """The leader's evaluation and task scores over the whole model (the others' parts read at its fragments'
        rounds; initial() before its state exists); none on the others."""
        if self.gathering is None:
            return {"evaluate": None, "tasks": None}
        reading = {"rounds": lambda: [f.round for f in fragments()], "initial": initial, "ready": lambda: bool(fragments())}
        return {"evaluate": self.gathering.evaluating(evaluate, missing=math.nan, **reading),
                "tasks": self.gathering.evaluating(tasks, missing={}, **reading)}

    def close(self) -> None:
        self.judging.close()
        for part in (self.followers, self.gathering):
            if part is not None:
                part.close()
