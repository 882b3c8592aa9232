"""This process's place in a coordinator of several shards (docs/sharding.md): its index, every shard's address,
the secret the shards share; and the parameters it holds.

Each shard learns its index and the count the way the field launches multi-process
jobs: `--shard I` given by hand, or from the launcher's environment (torchrun's
RANK and WORLD_SIZE, SLURM's SLURM_PROCID and SLURM_NTASKS, a Kubernetes
StatefulSet pod's ordinal at the end of its hostname); `diloco-coordinator serve
--shards K` starts K local shards itself. No cluster manager of our own.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from diloco.config import ConfigError, RunConfig
from diloco.fragments import layout_for
from diloco.models.llama import initial_parameters, parameter_shapes
from diloco.sharded_checkpoint import common_step, shard_url
from diloco.shardmap import ShardMap, ticket, ticket_valid
from diloco.wire.messages import Manifest

SECRET_ENV = "DILOCO_SHARD_SECRET"  # hex; made by `serve --shards K`, handed to remote shards by their launcher


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
        return bool(presented) and ticket_valid(self.secret, presented, island_id, owner or "", ranks)

    def checkpoint_url(self, base: str) -> str:
        """Where this shard checkpoints its part: a folder of its own under the run's checkpoint.url."""
        return shard_url(base, self.index, self.count)

    def common_step(self, base: str, keep_last: int) -> int | None:
        """The newest checkpoint step every shard committed (diloco/sharded_checkpoint.py)."""
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


def launcher_index(environ: Mapping[str, str] = os.environ, hostname: str | None = None) -> tuple[int, int] | None:
    """(index, count) from the launcher's environment, or None outside one. A StatefulSet gives only the
    ordinal (its hostname's "-N" suffix): the count is then None's job, given by --shards."""
    for rank, size in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in environ and size in environ:
            return int(environ[rank]), int(environ[size])
    if "KUBERNETES_SERVICE_HOST" in environ:
        m = re.search(r"-(\d+)$", hostname or socket.gethostname())
        if m:
            return int(m.group(1)), 0
    return None


def shard_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    raw = environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(f"a coordinator of several shards needs the shards' shared secret: set {SECRET_ENV} to the same "
                          "32+ hex digits on every shard (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`); "
                          "`serve --shards K` on one machine makes one itself")
    return secret
