"""The island's training loop, top to bottom.

join -> fetch theta_global -> inner steps, and at each fragment's sync step:
push theta_global_f - theta_local_f, pull the fragment's new theta_global_f,
mix it in -> leave.

Without streaming there is one fragment, it syncs every H inner steps and the
exchange blocks (tau = 0): plain DiLoCo. With Streaming DiLoCo (P fragments,
see diloco/fragments.py) fragment f syncs at its own offset; its exchange runs
in the background (islands/exchange.py) and lands tau inner steps later, where
theta_local_f = alpha * theta_local_f + (1 - alpha) * theta_global_f (eager
updates: see diloco/streaming.py). Inner steps are numbered across the whole
run; the inner AdamW state lives across rounds (never reset or synced), and the
learning-rate schedule is indexed by that global inner step.

Checkpoints are written right after a landing with no exchange in flight, so
no network state needs saving; a resumed island replays exactly what it would
have done.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import grpc
import torch

from diloco.checkpoint import CheckpointStore
from diloco.codec import ErrorFeedback
from diloco.config import RunConfig
from diloco.data import train_stream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.model import Transformer
from diloco.outer import pseudo_gradient
from diloco.params import checksum, module_checksum
from diloco.streaming import eager_gradient, mix_, swap_estimate_
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, downlink_codec, tensor_chunks, uplink_codec
from islands import durable
from islands.client import CoordinatorClient, MeanBuffer, ReplayableChunks
from islands.joining import check_join_reply, join_run
from islands.exchange import EagerState, Exchange, push_and_pull
from islands.outcome import Next, next_step, reason_name
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
    # Where the island's wall time went: inner steps, waiting for results, all of it.
    compute_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0
    inner_steps: int = 0
    straggler_s: float = 0.0  # of wait_s, waiting for other islands' pushes

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s else math.nan


class Island:
    def __init__(
        self, cfg: RunConfig, world: IslandWorld, client: CoordinatorClient | None, joined: pb.JoinResponse,
        compile_model: bool = False,
    ):
        self.cfg = cfg
        self.world = world
        self.client = client  # None on follower ranks
        self.island_id = joined.island_id
        self.manifest = Manifest.from_proto(joined.parameters)
        self.codec = uplink_codec(cfg.wire)
        self.down = downlink_codec(cfg.wire)
        if client is not None:
            client.codecs[self.down.name] = self.down
        self.chunk_bytes = joined.max_chunk_bytes
        self.total_rounds = joined.total_rounds
        self.model = Transformer(cfg.model).to(world.device)
        self.layout = check_join_reply(joined, cfg, Manifest.of(dict(self.model.named_parameters())))
        if compile_model:
            # In place (nn.Module.compile): parameter names, and so the manifest and checkpoints, stay as they are.
            self.model.compile()
        self.optimizer = build_inner_optimizer(self.model, cfg.inner)
        # Every rank of the island reads its own slice of the island's shard.
        shards = cfg.data.shards * world.world_size
        self.data = train_stream(cfg.data, cfg.seed, joined.shard_index * world.world_size + world.rank, shards)
        # theta_global stays in fp32 on the CPU: the outer step never needs it on the GPU.
        self.global_params = {n: torch.zeros(s, dtype=torch.float32) for n, s in self.manifest.shapes.items()}
        self.feedback = (ErrorFeedback(self.manifest.shapes, cfg.wire.decay, cfg.wire.feedback_in_model)
                         if cfg.wire.uses_error_feedback else None)
        self.resyncs = 0
        # --- fragments (one without streaming) ---
        s = cfg.streaming
        self.tau, self.alpha = s.overlap, s.alpha
        if world.world_size > 1 and (len(self.layout) > 1 or self.tau > 0 or s.eager):
            raise ValueError("streaming (fragments > 1, tau > 0 or eager) needs one-rank islands")
        named = dict(self.model.named_parameters())
        p = len(self.layout)
        self.local_f = [self.layout.subset(f, named) for f in range(p)]
        self.global_f = [self.layout.subset(f, self.global_params) for f in range(p)]
        self.manifest_f = [Manifest.of(g) for g in self.global_f]
        self.rounds = list(joined.fragment_rounds) or [joined.round] * p
        self.checksums = [""] * p
        self.step = 0  # inner steps completed (c), counted across the whole run
        self.last_sync = [0] * p  # c at which each fragment's current round began here
        self.pending_loss = [[0.0, 0] for _ in range(p)]  # loss sum and count since then
        self.in_flight: dict[int, Exchange] = {}
        self.eager = [EagerState.fresh(cfg.outer) for _ in range(p)] if s.eager else None
        self.rounds_done = 0  # fragment 0's rounds landed (rounds, without streaming)
        self.run_finished = False
        self.restored = False
        # Inner steps; blocked waiting for results (of which: for other islands' pushes); everything.
        self.timing = {"compute_s": 0.0, "wait_s": 0.0, "straggler_s": 0.0, "wall_s": 0.0}
        self.exchanges: list[dict] = []  # one record per landed exchange
        self.step_spans: list[tuple[float, float]] | None = None  # set to [] to record each inner step's span

    @property
    def round(self) -> int:
        """Fragment 0's round (the island's round without streaming)."""
        return self.rounds[0]

    @property
    def global_checksum(self) -> str:
        return self.checksums[0] if len(self.layout) == 1 else checksum(self.global_params)

    def _finished(self) -> bool:
        return self.run_finished or all(r >= self.total_rounds for r in self.rounds)

    # --- talking to the coordinator -------------------------------------------------

    @torch.no_grad()
    def _start(self) -> None:
        """Fetches theta_global; a fresh island adopts it, a restored one keeps the fragments it has right."""
        adopt = [True] * len(self.layout)
        info = None
        if self.world.is_leader:
            into = self.global_params if not self.restored else {n: torch.empty_like(t) for n, t in self.global_params.items()}
            header = self.client.fetch(self.island_id, into, self.manifest)
            rounds = [f.round for f in header.fragments] or [header.round]
            sums = [f.checksum for f in header.fragments] or [header.checksum]
            if self.restored:
                adopt = [(r, c) != (mine, own) for r, c, mine, own in zip(rounds, sums, self.rounds, self.checksums)]
                for f in (f for f, a in enumerate(adopt) if a):
                    for name, t in self.global_f[f].items():
                        t.copy_(into[name])
            if not self.restored or any(adopt):
                if self.restored:
                    log.warning("%s: checkpoint is at fragment rounds %s, the coordinator at %s; resyncing %s",
                                self.island_id, self.rounds, rounds, [f for f, a in enumerate(adopt) if a])
                self.rounds = [r if a else mine for r, a, mine in zip(rounds, adopt, self.rounds)]
                self.checksums = [c if a else own for c, a, own in zip(sums, adopt, self.checksums)]
                self.step = self.layout.start_step(self.rounds, self.total_rounds)
                self.last_sync = [self.step] * len(self.layout)
                self.pending_loss = [[0.0, 0] for _ in self.layout]
            info = (self.rounds, self.checksums, self.step, header.run_finished, adopt)
        self.rounds, self.checksums, self.step, self.run_finished, adopt = self.world.broadcast_object(info)
        self.world.broadcast_tensors(self.global_params)
        for f, a in enumerate(adopt):
            if a:
                mix_(self.local_f[f], self.global_f[f], 0.0)  # theta_local <- theta_global

    def _exchange(self, ex: Exchange, header: pb.PushHeader, chunks: ReplayableChunks) -> pb.ResultHeader:
        """Leader: push the pseudo-gradient, pull the round's result (on the exchange's thread)."""
        f = ex.fragment
        return push_and_pull(
            self.client, header, chunks, self.global_f[f], self.manifest_f[f], self.checksums[f],
            self.cfg.rounds.deadline_s + 60, ex.mean,
        )

    def _resync(self, f: int, error: grpc.RpcError) -> None:
        """Fragment f's round went on without us: fetch its current global parameters and carry on from there."""
        step = next_step(error)
        if step is Next.REJOIN:
            joined = self.client.join(self.cfg.digest(), self.codec.name, self.island_id)
            self.island_id = joined.island_id
        elif step is Next.RESET:
            # Our training diverged: start the inner optimizer afresh from the global parameters.
            self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
            if self.feedback is not None:
                self.feedback = ErrorFeedback(self.manifest.shapes, self.cfg.wire.decay, self.cfg.wire.feedback_in_model)
        elif step not in (Next.RESYNC, Next.FINISHED, Next.PUSH_AGAIN):
            raise error
        details = f"{reason_name(error)}: {error.details()}"
        label = f"fragment {f} " if len(self.layout) > 1 else ""
        log.warning("%s resyncs %safter round %d: %s", self.island_id, label, self.rounds[f], details)
        self.resyncs += 1
        one = None if len(self.layout) == 1 else f
        header = self.client.fetch(self.island_id, self.global_f[f], self.manifest_f[f], fragment=one)
        self.rounds[f], self.checksums[f] = header.round, header.checksum
        self.run_finished = self.run_finished or header.run_finished

    # --- one fragment's sync: the push, and tau inner steps later the landing ------------

    def _sync(self, f: int, tokens_per_step: int) -> None:
        """Snapshots fragment f's pseudo-gradient and starts its exchange (inline when tau = 0)."""
        c, h = self.step, self.cfg.inner.steps_per_round
        blocking = self.tau == 0
        due = c if blocking or c >= self.total_rounds * h else c + self.tau
        steps = c - self.last_sync[f]
        if steps <= 0:
            log.warning("%s: fragment %d is due with no inner step trained for it; pushing it with one step's weight", self.island_id, f)
        loss_sum, n = self.pending_loss[f]
        pg = pseudo_gradient(self.global_f[f], self.local_f[f])
        ex = Exchange(f, self.rounds[f], c, due, pg, tokens=max(steps, 1) * tokens_per_step)
        eager = self.eager[f] if self.eager is not None else None
        if eager is not None:
            ex.mean = MeanBuffer({n_: torch.zeros_like(t) for n_, t in pg.items()}, self.manifest_f[f], self.down)
            if eager.prev_mean is not None and due > c:  # no window to fill when the result lands at once
                ex.estimate = eager.replica.step(self.global_f[f], eager_gradient(eager.prev_mean, eager.prev_own, pg, eager.share))
                mix_(self.local_f[f], ex.estimate, self.alpha)
        self.last_sync[f], self.pending_loss[f] = c, [0.0, 0]
        self.in_flight[f] = ex
        if not self.world.is_leader:
            return
        header = pb.PushHeader(
            island_id=self.island_id, round=self.rounds[f], tokens=ex.tokens,
            train_loss=loss_sum / n if n else 0.0, codec=self.codec.name, inner_steps=max(steps, 1),
            global_checksum=self.checksums[f], fragment=f,
        )
        chunks = ReplayableChunks(tensor_chunks(pg, self.codec, self.chunk_bytes, feedback=self.feedback))
        ex.run(lambda: self._exchange(ex, header, chunks), background=not blocking)
        if blocking:  # the whole exchange was spent waiting for the coordinator
            self._count_wait(ex, ex.finished_at - ex.started_at)

    @torch.no_grad()
    def _land(self, f: int) -> None:
        """Waits for fragment f's exchange and mixes its result in (or resyncs the fragment)."""
        ex = self.in_flight.pop(f)
        waited = time.monotonic()
        info = None
        round_tokens = 0  # tokens aggregated in the round that landed
        if self.world.is_leader:
            outcome = ex.wait()
            if isinstance(outcome, grpc.RpcError):
                self._resync(f, outcome)
                kind = "resync"
            else:
                self.rounds[f], self.checksums[f] = outcome.round, outcome.checksum
                self.run_finished = self.run_finished or outcome.run_finished
                kind, round_tokens = "result", outcome.tokens
            info = (kind, self.rounds[f], self.checksums[f], self.run_finished, self.island_id)
        kind, self.rounds[f], self.checksums[f], self.run_finished, self.island_id = self.world.broadcast_object(info)
        self.world.broadcast_tensors(self.global_f[f])
        final = self.rounds[f] >= self.total_rounds  # the island ends holding exactly the global parameters
        eager = self.eager[f] if self.eager is not None else None
        if kind == "resync" or final:
            mix_(self.local_f[f], self.global_f[f], 0.0)
            self.last_sync[f], self.pending_loss[f] = self.step, [0.0, 0]
        elif ex.estimate is not None:
            swap_estimate_(self.local_f[f], self.global_f[f], ex.estimate, self.alpha)
        else:
            mix_(self.local_f[f], self.global_f[f], self.alpha)
            if self.feedback is not None and self.feedback.in_model and kind == "result":
                # What the codec did not send stays in this island's parameters (only the leader encoded it).
                residual = self.layout.subset(f, self.feedback.buffers)
                self.world.broadcast_tensors(residual)
                self.feedback.keep_residual_(self.local_f[f], 1.0 - self.alpha)
        if eager is not None:
            if kind == "result" and ex.mean is not None and ex.mean.complete and round_tokens > 0:
                eager.replica.advance(ex.mean.tensors)
                eager.prev_mean, eager.prev_own, eager.share = ex.mean.tensors, ex.pg, min(1.0, ex.tokens / round_tokens)
            else:
                eager.forget()
        ex.landed_at = time.monotonic()
        if not ex.inline:  # an inline exchange counted its whole duration already
            self._count_wait(ex, ex.landed_at - waited)
        log.debug("%s fragment %d round %d: pushed after step %d, landed after step %d, exchange %.3fs, waited %.3fs",
                  self.island_id, f, ex.round, ex.pushed_step, self.step, ex.finished_at - ex.started_at, ex.landed_at - waited)
        self.exchanges.append(ex.record())
        if f == 0:
            self.rounds_done += 1

    def _count_wait(self, ex: Exchange, blocked: float) -> None:
        """Time blocked on an exchange; the part the coordinator held our pull for others' pushes is the stragglers'."""
        held = ex.outcome.held_s if isinstance(ex.outcome, pb.ResultHeader) else 0.0
        self.timing["wait_s"] += blocked
        self.timing["straggler_s"] += min(blocked, held)

    def _tokens_per_step(self) -> int:
        return self.cfg.inner.batch_size * self.cfg.data.seq_len * self.world.world_size

    def _boundary(self, store: CheckpointStore | None, every: int) -> None:
        """After self.step inner steps: land what is due, checkpoint if nothing is in flight, start what is due."""
        landed = False
        for f in sorted(self.in_flight):
            if self.in_flight[f].due <= self.step:
                self._land(f)
                landed = True
        self._maybe_checkpoint(landed, store, every)
        for f in range(len(self.layout)):
            if f in self.in_flight or self.rounds[f] >= self.total_rounds or self.run_finished:
                continue
            if self.step >= self.layout.round_end(f, self.rounds[f], self.total_rounds):
                self._sync(f, self._tokens_per_step())
                if self.in_flight[f].due <= self.step:
                    self._land(f)
                    self._maybe_checkpoint(True, store, every)

    def _maybe_checkpoint(self, landed: bool, store: CheckpointStore | None, every: int) -> None:
        total = sum(self.rounds)
        if (
            store is None or not landed or self.in_flight or self._finished()
            or total % (every * len(self.layout)) or total == self._saved_at
        ):
            return
        durable.save(self, store)
        self._saved_at = total

    # --- the loop -------------------------------------------------------------------

    def run(self, max_rounds: int | None = None, store: CheckpointStore | None = None, every: int = 1) -> IslandResult:
        cfg = self.cfg.inner
        h = cfg.steps_per_round
        total_steps = self.total_rounds * h
        self._saved_at = -1
        if store is not None and self.tau > self.layout.min_spacing():
            log.warning("%s: tau=%d exceeds the %d steps between fragments' syncs: an exchange is always in flight "
                        "and no checkpoint will be written", self.island_id, self.tau, self.layout.min_spacing())
        self._start()
        started = time.monotonic()
        losses: list[float] = []
        wave: list[float] = []
        marks = {h: None, total_steps - h: None} if self.total_rounds >= 3 else {}
        while True:
            self._boundary(store, every)
            if self.step in marks and marks[self.step] is None:
                marks[self.step] = (self.timing["compute_s"], time.monotonic())
            if self._finished() or self.step >= total_steps or (max_rounds is not None and self.rounds_done >= max_rounds):
                break
            c = self.step
            lr = inner_lr(c, total_steps, cfg)
            batch = self.data.next_batch(cfg.batch_size)
            if self.world.device.type == "cuda":
                # Charge this step only, not GPU work queued before it (a landing's copies into the
                # model); train_step's loss.item() then waits for the step's own kernels.
                torch.cuda.synchronize(self.world.device)
            t0 = time.monotonic()
            loss = train_step(self.model, self.optimizer, batch, lr, cfg.grad_clip, self.world.average_gradients, self.world.device)
            t1 = time.monotonic()
            self.timing["compute_s"] += t1 - t0
            if self.step_spans is not None:
                self.step_spans.append((t0, t1))
            for pending in self.pending_loss:
                pending[0] += loss
                pending[1] += 1
            wave.append(loss)
            self.step += 1
            if self.step % h == 0:
                losses.append(sum(wave) / len(wave))
                log.info("%s step %d: train loss %.4f, fragment rounds %s; %.1fs in inner steps, %.1fs waiting so far",
                         self.island_id, self.step, losses[-1], self.rounds, self.timing["compute_s"], self.timing["wait_s"])
                wave = []
        for f in sorted(self.in_flight):  # leaving early (max_rounds): let what is in flight land
            self._land(f)
        self.timing["wall_s"] = time.monotonic() - started
        if marks and all(marks.values()):
            (c0, t0), (c1, t1) = marks[h], marks[total_steps - h]
            self.timing["steady_compute_s"], self.timing["steady_wall_s"] = c1 - c0, t1 - t0
        final = module_checksum(self.model)
        matches = False
        if self.world.is_leader:
            stats = dict(self.timing, inner_steps=self.step)
            matches = self.client.leave(self.island_id, final, self.round, stats)
        return IslandResult(
            self.island_id, self.rounds_done, self.round, final, matches, losses,
            self.timing["compute_s"], self.timing["wait_s"], self.timing["wall_s"], self.step, self.timing["straggler_s"],
        )


def join_and_run(
    address: str,
    cfg: RunConfig | None,
    world: IslandWorld,
    max_rounds: int | None = None,
    connect_timeout_s: float = 60.0,
    checkpoint_url: str = "",
    checkpoint_every: int = 1,
    resume: bool = False,
    compile_model: bool = False,
) -> IslandResult | None:
    """Joins the coordinator at address (config None: adopt the coordinator's) and trains to the end;
    None if the run had already finished.

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
    client = CoordinatorClient(address, connect_timeout_s) if world.is_leader else None
    try:
        joined = join_run(client, world, cfg, previous["island_id"] if previous else "")
        if joined is None:
            return None
        joined, run_cfg = joined
        torch.manual_seed(run_cfg.seed + 1000 * world.rank)
        island = Island(run_cfg, world, client, joined, compile_model)
        if previous is not None:
            durable.restore(island, store, prefer_step=sum(joined.fragment_rounds) if joined.fragment_rounds else joined.round)
        if client is not None:
            client.start_heartbeat(lambda: island.island_id, joined.heartbeat_interval_s, lambda: island.round)
        return island.run(max_rounds, store, checkpoint_every)
    finally:
        if client is not None:
            client.close()
