"""The island's training loop, top to bottom.

join -> fetch theta_global -> [H inner steps -> push theta_global - theta_local
-> pull the new theta_global -> adopt it] x rounds -> leave.

The inner AdamW state lives across rounds (never reset or synced), and the
learning-rate schedule is indexed by the inner step across the whole run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from diloco.codec import get_codec
from diloco.config import RunConfig
from diloco.data import train_stream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.model import Transformer
from diloco.outer import pseudo_gradient
from diloco.params import module_checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest
from islands.client import CoordinatorClient
from islands.world import IslandWorld

log = logging.getLogger(__name__)


@dataclass
class IslandResult:
    island_id: str
    rounds: int
    final_round: int
    checksum: str
    checksum_matches: bool
    losses: list[float] = field(default_factory=list)


class Island:
    def __init__(self, cfg: RunConfig, world: IslandWorld, client: CoordinatorClient | None, joined: pb.JoinResponse):
        self.cfg = cfg
        self.world = world
        self.client = client  # None on follower ranks
        self.island_id = joined.island_id
        self.manifest = Manifest.from_proto(joined.parameters)
        self.codec = get_codec(joined.codec)
        self.chunk_bytes = joined.max_chunk_bytes
        self.total_rounds = joined.total_rounds
        self.round = joined.round
        self.model = Transformer(cfg.model).to(world.device)
        if Manifest.of(dict(self.model.named_parameters())) != self.manifest:
            raise RuntimeError("the coordinator's parameter manifest does not match this island's model; check model config")
        self.optimizer = build_inner_optimizer(self.model, cfg.inner)
        # Every rank of the island reads its own slice of the island's shard.
        shards = cfg.data.shards * world.world_size
        self.data = train_stream(cfg.data, cfg.seed, joined.shard_index * world.world_size + world.rank, shards)
        # theta_global stays in fp32 on the CPU: the outer step never needs it on the GPU.
        self.global_params = {n: torch.zeros(s, dtype=torch.float32) for n, s in self.manifest.shapes.items()}

    # --- talking to the coordinator (leader only), then sharing with the island ---

    def _sync_global(self, fetch: bool, pull_round: int = -1) -> tuple[int, bool]:
        """Leader fetches or pulls theta_global; every rank then holds it. Returns (round, finished)."""
        header = None
        if self.world.is_leader:
            if fetch:
                header = self.client.fetch(self.island_id, self.global_params, self.manifest, self.codec)
            else:
                header = self.client.pull(
                    self.island_id, pull_round, self.global_params, self.manifest, self.codec,
                    timeout_s=self.cfg.rounds.deadline_s + 60,
                )
        round_, finished = self.world.broadcast_object((header.round, header.run_finished) if header else None)
        self.world.broadcast_tensors(self.global_params)
        self._adopt()
        return round_, finished

    @torch.no_grad()
    def _adopt(self) -> None:
        """theta_local <- theta_global (the inner optimizer state is kept)."""
        for name, p in self.model.named_parameters():
            p.copy_(self.global_params[name].to(p.device, p.dtype))

    def _push(self, tokens: int, train_loss: float) -> bool:
        """Leader pushes the pseudo-gradient; False when the round closed without it."""
        ok = True
        if self.world.is_leader:
            pg = pseudo_gradient(self.global_params, dict(self.model.named_parameters()))
            header = pb.PushHeader(
                island_id=self.island_id, round=self.round, tokens=tokens, train_loss=train_loss,
                codec=self.codec.name, inner_steps=self.cfg.inner.steps_per_round,
            )
            try:
                self.client.push(header, pg, self.codec, self.chunk_bytes)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                log.warning("round %d closed before our push landed (%s); resyncing", self.round, e.details())
                ok = False
        return self.world.broadcast_object(ok)

    # --- the loop -------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> IslandResult:
        cfg = self.cfg.inner
        h = cfg.steps_per_round
        total_steps = self.total_rounds * h
        tokens_per_step = cfg.batch_size * self.cfg.data.seq_len * self.world.world_size
        self.round, finished = self._sync_global(fetch=True)
        losses: list[float] = []
        rounds_done = 0
        while not finished and (max_rounds is None or rounds_done < max_rounds):
            started = time.monotonic()
            round_losses = []
            for i in range(h):
                step = self.round * h + i
                lr = inner_lr(step, total_steps, cfg)
                batch = self.data.next_batch(cfg.batch_size)
                round_losses.append(
                    train_step(self.model, self.optimizer, batch, lr, cfg.grad_clip, self.world.average_gradients, self.world.device)
                )
            train_loss = sum(round_losses) / len(round_losses)
            losses.append(train_loss)
            compute_s = time.monotonic() - started
            if self._push(tokens_per_step * h, train_loss):
                self.round, finished = self._sync_global(fetch=False, pull_round=self.round)
            else:
                self.round, finished = self._sync_global(fetch=True)
            rounds_done += 1
            log.info(
                "%s round %d: train loss %.4f, %.1fs inner steps, %.1fs total",
                self.island_id, self.round - 1, train_loss, compute_s, time.monotonic() - started,
            )
        final = module_checksum(self.model)
        matches = False
        if self.world.is_leader:
            matches = self.client.leave(self.island_id, final, self.round)
        return IslandResult(self.island_id, rounds_done, self.round, final, matches, losses)


def join_and_run(
    address: str, cfg: RunConfig | None, world: IslandWorld, max_rounds: int | None = None, connect_timeout_s: float = 60.0
) -> IslandResult:
    """Joins the coordinator at address (config None: adopt the coordinator's) and trains to the end."""
    from diloco.config import config_from_toml

    client = None
    joined = None
    if world.is_leader:
        client = CoordinatorClient(address, connect_timeout_s)
        joined = client.join(cfg.digest() if cfg is not None else "")
    joined_bytes = world.broadcast_object(joined.SerializeToString() if joined else None)
    joined = pb.JoinResponse.FromString(joined_bytes)
    run_cfg = cfg if cfg is not None else config_from_toml(joined.config_toml)
    torch.manual_seed(run_cfg.seed + 1000 * world.rank)
    try:
        island = Island(run_cfg, world, client, joined)
        if client is not None:
            client.start_heartbeat(joined.island_id, joined.heartbeat_interval_s, lambda: island.round)
        return island.run(max_rounds)
    finally:
        if client is not None:
            client.close()
