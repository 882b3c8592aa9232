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

from diloco.codec import ErrorFeedback
from diloco.checkpoint import CheckpointStore
from diloco.config import RunConfig, config_from_toml
from diloco.data import train_stream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.model import Transformer
from diloco.outer import pseudo_gradient
from diloco.params import module_checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, downlink_codec, tensor_chunks, uplink_codec, uses_error_feedback
from islands import durable
from islands.client import CoordinatorClient, ReplayableChunks
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
        self.codec = uplink_codec(cfg.wire)
        if self.codec.name != joined.codec:
            raise RuntimeError(f"this island's codec {self.codec.name!r} is not the run's {joined.codec!r}")
        down = downlink_codec(cfg.wire)
        if client is not None:
            client.codecs[down.name] = down
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
        self.global_checksum = ""
        self.feedback = ErrorFeedback(self.manifest.shapes, cfg.wire.feedback_decay) if uses_error_feedback(cfg.wire) else None
        self.resyncs = 0

    # --- talking to the coordinator (leader only), then sharing with the island ---

    def _share(self, header: pb.ResultHeader | None) -> tuple[int, bool]:
        """Leader's theta_global to every rank, then theta_local <- theta_global."""
        round_, finished = self.world.broadcast_object((header.round, header.run_finished) if header else None)
        self.world.broadcast_tensors(self.global_params)
        self._adopt()
        return round_, finished

    def _fetch(self) -> pb.ResultHeader:
        header = self.client.fetch(self.island_id, self.global_params, self.manifest)
        self.global_checksum = header.checksum
        return header

    @torch.no_grad()
    def _adopt(self) -> None:
        """theta_local <- theta_global (the inner optimizer state is kept)."""
        for name, p in self.model.named_parameters():
            p.copy_(self.global_params[name].to(p.device, p.dtype))

    def _exchange(self, tokens: int, train_loss: float) -> pb.ResultHeader:
        """Leader: push the pseudo-gradient, pull the round's result; resync whenever the round is lost to us."""
        pg = pseudo_gradient(self.global_params, dict(self.model.named_parameters()))
        chunks = ReplayableChunks(tensor_chunks(pg, self.codec, self.chunk_bytes, feedback=self.feedback))
        header = pb.PushHeader(
            island_id=self.island_id, round=self.round, tokens=tokens, train_loss=train_loss,
            codec=self.codec.name, inner_steps=self.cfg.inner.steps_per_round, global_checksum=self.global_checksum,
        )
        for _ in range(3):
            try:
                self.client.push(header, chunks)
            except grpc.RpcError as e:
                return self._resync(e)
            try:
                result = self.client.pull(
                    self.island_id, self.round, self.global_params, self.manifest, self.global_checksum,
                    timeout_s=self.cfg.rounds.deadline_s + 60,
                )
                self.global_checksum = result.checksum
                return result
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "push again" in (e.details() or ""):
                    log.warning("%s: %s", self.island_id, e.details())
                    continue  # the coordinator lost our contribution (restart): resend the same chunks
                return self._resync(e)
        return self._resync(None)

    def _resync(self, error: grpc.RpcError | None) -> pb.ResultHeader:
        """The round went on without us: fetch the current global parameters and carry on from there."""
        code = error.code() if error is not None else None
        details = error.details() if error is not None else "contribution lost repeatedly"
        if code == grpc.StatusCode.NOT_FOUND:
            joined = self.client.join(self.cfg.digest(), self.codec.name, self.island_id)
            self.island_id = joined.island_id
        elif code == grpc.StatusCode.INVALID_ARGUMENT and "not finite" in details:
            # Our training diverged: start the inner optimizer afresh from the global parameters.
            self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
            if self.feedback is not None:
                self.feedback = ErrorFeedback(self.manifest.shapes, self.cfg.wire.feedback_decay)
        elif code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS, None):
            raise error
        log.warning("%s resyncs after round %d: %s", self.island_id, self.round, details)
        self.resyncs += 1
        return self._fetch()

    # --- the loop -------------------------------------------------------------------

    def run(self, max_rounds: int | None = None, store: CheckpointStore | None = None, every: int = 1) -> IslandResult:
        cfg = self.cfg.inner
        h = cfg.steps_per_round
        total_steps = self.total_rounds * h
        tokens_per_step = cfg.batch_size * self.cfg.data.seq_len * self.world.world_size
        self.round, finished = self._share(self._fetch() if self.world.is_leader else None)
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
            trained_round = self.round
            result = self._exchange(tokens_per_step * h, train_loss) if self.world.is_leader else None
            self.round, finished = self._share(result)
            rounds_done += 1
            if store is not None and not finished and self.round % every == 0:
                durable.save(self, store)
            log.info(
                "%s round %d: train loss %.4f, %.1fs inner steps, %.1fs total",
                self.island_id, trained_round, train_loss, compute_s, time.monotonic() - started,
            )
        final = module_checksum(self.model)
        matches = False
        if self.world.is_leader:
            matches = self.client.leave(self.island_id, final, self.round)
        return IslandResult(self.island_id, rounds_done, self.round, final, matches, losses)


def join_and_run(
    address: str,
    cfg: RunConfig | None,
    world: IslandWorld,
    max_rounds: int | None = None,
    connect_timeout_s: float = 60.0,
    checkpoint_url: str = "",
    checkpoint_every: int = 1,
    resume: bool = False,
) -> IslandResult:
    """Joins the coordinator at address (config None: adopt the coordinator's) and trains to the end.

    With checkpoint_url the island checkpoints every checkpoint_every rounds;
    with resume it first restores the newest checkpoint there and rejoins as
    the same island.
    """
    store = None
    if checkpoint_url:
        url = checkpoint_url if world.world_size == 1 else f"{checkpoint_url.rstrip('/')}/rank-{world.rank}"
        store = CheckpointStore(url)
    elif resume:
        raise ValueError("--resume needs --checkpoint URL")
    previous = durable.peek(store) if resume and store is not None else None
    client = None
    joined = None
    if world.is_leader:
        client = CoordinatorClient(address, connect_timeout_s)
        codec = uplink_codec(cfg.wire).name if cfg is not None else ""
        joined = client.join(cfg.digest() if cfg is not None else "", codec, previous["island_id"] if previous else "")
    joined_bytes = world.broadcast_object(joined.SerializeToString() if joined else None)
    joined = pb.JoinResponse.FromString(joined_bytes)
    run_cfg = cfg if cfg is not None else config_from_toml(joined.config_toml)
    torch.manual_seed(run_cfg.seed + 1000 * world.rank)
    try:
        island = Island(run_cfg, world, client, joined)
        if previous is not None:
            durable.restore(island, store, prefer_round=joined.round)
        if client is not None:
            client.start_heartbeat(lambda: island.island_id, joined.heartbeat_interval_s, lambda: island.round)
        return island.run(max_rounds, store, checkpoint_every)
    finally:
        if client is not None:
            client.close()
