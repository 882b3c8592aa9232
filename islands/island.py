"""The island: one loop for every kind, from one rank to R replica groups x N FSDP ranks.

A one-rank island is the small case of the same thing: a world of one rank
(the model unsharded) in a solo replica group (no torchft). Every iteration of
the loop is one step, taken by the replica groups in lock step through torchft
(islands/replicas.py), whose quorum may heal a restarted group. A step is
either boundary work or an inner step:

- boundary: a fragment's exchange that is due lands (the groups agree on the
  push outcome, every rank pulls its ranges, the result is mixed in), or a
  fragment whose round ends begins its exchange: blocking with tau = 0 (plain
  DiLoCo), overlapped with tau > 0 (Streaming DiLoCo: it lands tau inner steps
  later while training goes on);
- inner step: the batch of inner step c (a pure function of island, rank and
  c), gradients averaged across the groups, the optimizer steps only if the
  step commits, else the same step is redone.

Fragments (diloco/fragments.py) split the model; without streaming there is one,
which syncs every H inner steps. The island's position (IslandState) is what a
checkpoint writes and a healing group receives, with the model shard, inner
optimizer state, theta_global shard, error feedback, eager state and the
exchanges in flight. What the loop, the round, the checkpoint and the
telemetry share is one object, `self.ctx` (islands/context.py IslandContext;
`island.ctx.model` is the model). The island's side of the round (when
one ends, the exchange, the landing, a resync, the finish) is one object built
on it, `self.sync` (islands/round.py IslandRound); the loop below is the
schedule that calls it, top to bottom:

    if not rounds.boundary():
        rounds.after_step(*inner_step())   # inner_step calls rounds.step_begins() and rounds.reduce_gradients
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from diloco.config import RunConfig
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.shardmap import model_checksum
from diloco.streaming import EagerState
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.feedback import ErrorFeedback
from diloco.wire.messages import Manifest, downlink_codec, link_codecs, uplink_codec
from islands.client import CoordinatorClient
from islands.context import FragmentShard, IslandContext
from islands.evidence import Evidence, Faults, digest
from islands.feed import make_feed
from islands.fsdp import ShardLayout, build_island_model, local_views
from islands.joining import check_join_reply
from islands.replicas import ReplicaGroups, Replicas
from islands.round import IslandRound, Wire
from islands.state import IslandState, ReplicaSpec
from islands.telemetry import IslandTelemetry
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
    late_folds: int = 0  # pushes the coordinator folded into a later round (rounds.late_rounds)

    @property
    def utilization(self) -> float:
        return self.compute_s / self.wall_s if self.wall_s else math.nan


class Stepped(NamedTuple):
    """One inner step, as the round counts it (IslandRound.after_step) and the telemetry records it."""

    loss: float | None  # None: the step did not commit (it is redone)
    tokens: int = 0  # the island's tokens of the step (every participating group's ranks)
    samples: int = 0  # the samples it read of a token corpus
    seconds: float = 0.0


class Island:
    """One rank's island: it builds the parts (the context), then runs the loop; the round is `self.sync`."""

    def __init__(self, cfg: RunConfig, world: IslandWorld, client: CoordinatorClient, joined: pb.JoinResponse,
                 spec: ReplicaSpec | None = None, compile_model: bool = False):
        spec = spec or ReplicaSpec()
        codec, down = uplink_codec(cfg.wire), downlink_codec(cfg.wire)
        client.codecs[down.name] = down
        manifest = Manifest.from_proto(joined.parameters)
        model = build_island_model(cfg.model, world.device, world.world_size, compile_model)
        layout = check_join_reply(joined, cfg, Manifest.of(dict(model.named_parameters())))
        self.shard = ShardLayout.of(model)
        self.whole = world.world_size == 1  # the rank holds the whole model
        local = local_views(model)
        # theta_global stays in fp32 on the CPU: the outer step never needs it on the GPU.
        global_shard = ({n: torch.zeros(s, dtype=torch.float32) for n, s in manifest.shapes.items()}
                        if self.whole else self.shard.zeros())
        optimizer = build_inner_optimizer(model, cfg.inner)
        feedback = (ErrorFeedback({r.name: r.numel for r in self.shard.ranges}, cfg.wire.decay, cfg.wire.feedback_in_model)
                    if cfg.wire.uses_error_feedback else None)
        params = FragmentShard(-1, manifest, self.shard.ranges, self.whole, local, global_shard)
        fragments = [params.part(f.index, f.names) for f in layout]
        p = len(fragments)
        state = IslandState(joined.island_id, list(joined.fragment_rounds) or [joined.round] * p, joined.total_rounds)
        self.feed = make_feed(cfg, joined, world, spec, client, lambda: state.island_id)
        # What the loop, the round, the checkpoint and the telemetry share.
        self.ctx = IslandContext(
            cfg, spec, world, client, state, layout, joined.total_rounds, model, optimizer, params, fragments,
            replicas=ReplicaGroups(world, spec.groups), feedback=feedback,
            eager=[EagerState(cfg.outer) for _ in range(p)] if cfg.streaming.eager else None, leased=self.feed.leased,
            evidence=Evidence(spec.report_dir, spec.group, world.rank), faults=Faults.from_env(spec.group, world.rank),
        )
        wire = Wire(client, codec, joined.max_chunk_bytes, feedback, cfg.rounds.deadline_s + 60, lambda: state.island_id,
                    link_codecs(cfg.wire), down)  # compression per link: what it may push with
        self.checkpoint = None  # islands.checkpoint.IslandCheckpoint with --checkpoint
        self.step_spans: list[tuple[float, float]] | None = None  # set to [] to record each inner step's span
        self.telemetry = IslandTelemetry()  # what it writes: islands/launch.py's run_island (--metrics-port, --log-url)
        # The island's side of the round: when one ends, the exchange, the landing, a resync, the finish.
        self.sync = IslandRound(self.ctx, wire)

    @property
    def island_id(self) -> str:
        return self.ctx.island_id

    @property
    def round(self) -> int:
        return self.ctx.state.round

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        return self.ctx.global_shard

    @property
    def losses(self) -> list[float]:
        """The mean inner loss of each round's steps."""
        return self.sync.losses

    # --- one inner step ---------------------------------------------------------------------------

    def _inner_step(self) -> Stepped:
        """Trains one inner step: its loss (None if it did not commit: redo it), the island's tokens, the samples read."""
        ctx, cfg, s = self.ctx, self.ctx.cfg.inner, self.ctx.state
        batch = self.feed.batch(s, ctx.replicas.participating_rank(), ctx.replicas.participants())
        if ctx.world.device.type == "cuda":
            # Charge this step only, not GPU work queued before it (a landing's copies into the model).
            torch.cuda.synchronize(ctx.world.device)
        t0 = time.monotonic()
        lr = inner_lr(self.sync.step_begins(), ctx.total_rounds * cfg.steps_per_round, cfg)
        loss = train_step(ctx.model, ctx.optimizer, batch, lr, cfg.grad_clip, self.sync.reduce_gradients, ctx.world.device,
                          autocast=self.whole)
        if ctx.spec.throttle_s:
            time.sleep(ctx.spec.throttle_s)  # a slower device, emulated: counted as compute
        t1 = time.monotonic()
        if loss is None:
            return Stepped(None)
        ctx.timing["compute_s"] += t1 - t0
        if self.step_spans is not None:
            self.step_spans.append((t0, t1))
        participants = ctx.replicas.participants()
        tokens = participants * ctx.world.world_size * cfg.batch_size * ctx.cfg.data.seq_len
        return Stepped(loss, tokens, self.feed.samples_per_step(participants), t1 - t0)

    def _close_timing(self, marks: dict, started: float) -> None:
        timing = self.ctx.timing
        timing["wall_s"] = time.monotonic() - started
        if marks and all(marks.values()):
            h = self.ctx.cfg.inner.steps_per_round
            (c0, t0), (c1, t1) = marks[h], marks[self.ctx.total_rounds * h - h]
            timing["steady_compute_s"], timing["steady_wall_s"] = c1 - c0, t1 - t0

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> IslandResult:
        started = time.monotonic()
        ctx, rounds, s, h = self.ctx, self.sync, self.ctx.state, self.ctx.cfg.inner.steps_per_round
        self.telemetry.attach(ctx)
        rounds.start()
        if max_rounds is not None:
            s.stop_round = min(s.stop_round, min(s.rounds) + max_rounds)
        if ctx.spec.groups > 1:
            ctx.replicas.use(Replicas(
                ctx.spec.ft, ctx.spec.group, ctx.world.rank, ctx.world.world_size, ctx.world.device,
                f"{ctx.spec.key}.group{ctx.spec.group}", self.heal_state_dict, self.load_heal_state_dict,
            ))
        total_steps = ctx.total_rounds * h
        # Steady state (LeaveRequest): between fixed steps of the fixed schedule; none with a pace of the island's own.
        marks = {h: None, total_steps - h: None} if ctx.total_rounds >= 3 and rounds.schedule.fixed else {}
        ctx.evidence.event("up", round=s.round)
        matches, finishing = None, 0
        assemble_until = time.monotonic() + ctx.spec.ft.startup_wait_s
        try:
            while True:
                replaced = getattr(ctx.client, "replaced", None)
                if replaced is not None:  # another process joined as this island (its heartbeat was refused REPLACED)
                    raise replaced
                healed = ctx.replicas.start_step()
                self.record_step(healed)
                if ctx.replicas.participants() < ctx.spec.groups and time.monotonic() < assemble_until and not healed:
                    # Starting together: wait (bounded) for every group, so that all of them train
                    # from the first step instead of the late ones healing in later.
                    ctx.replicas.commit()
                    time.sleep(0.1)
                    continue
                assemble_until = 0.0
                if self.checkpoint is not None and not rounds.inflight:
                    self.checkpoint.maybe_save(ctx)
                if rounds.done():
                    self._close_timing(marks, started)
                    finishing += 1
                    matches = rounds.finish(last_try=finishing >= 5)
                    if matches is not None:
                        break
                    continue
                if rounds.boundary():
                    self.telemetry.landed(ctx)
                    continue
                if s.step in marks and marks[s.step] is None:
                    marks[s.step] = (ctx.timing["compute_s"], time.monotonic())
                step = self._inner_step()
                rounds.after_step(step.loss, step.tokens, step.samples)
                if step.loss is not None:
                    self.telemetry.inner_step(step.loss, step.tokens, step.seconds)
        finally:
            self.telemetry.finish()
            self.write_evidence()
            ctx.replicas.shutdown()
        # The run's checksum (diloco/shardmap.py join_checksums), the same on every rank: a rank holding the whole model
        # computes it (a sharded coordinator's parts joined), the others take the one the coordinator confirmed at leave.
        whole = (model_checksum(dict(ctx.model.named_parameters()), getattr(ctx.client, "map", None)) if self.whole
                 else ctx.world.broadcast_object(rounds.final_checksum))
        t = ctx.timing
        return IslandResult(
            s.island_id, s.rounds_done, s.round, whole, bool(matches), rounds.losses, t["compute_s"],
            t["wait_s"], t["wall_s"], s.step, t["straggler_s"], rounds.late_folds,
        )

    # --- healing: what a restarted group receives from a live peer -----------------------------------

    def heal_state_dict(self) -> dict:
        from islands.fsdp import optimizer_state_to_local

        ctx = self.ctx
        return {
            "model": {n: t.detach() for n, t in ctx.local.items()},
            "optimizer": optimizer_state_to_local(ctx.optimizer),
            "global": ctx.global_shard,
            "feedback": ctx.feedback.state_dict() if ctx.feedback is not None else {},
            "eager": [e.state_dict() for e in ctx.eager] if ctx.eager is not None else [],
            "position": ctx.state.state_dict(),
            **self.sync.heal_state_dict(),  # the exchanges in flight and the round's clock
        }

    @torch.no_grad()
    def load_heal_state_dict(self, sd: dict) -> None:
        from islands.fsdp import optimizer_state_from_local

        ctx = self.ctx
        for name, t in sd["model"].items():
            ctx.local[name].copy_(t)
        for name, t in sd["global"].items():
            ctx.global_shard[name].copy_(t)
        if ctx.feedback is not None:
            ctx.feedback.load_state_dict(sd["feedback"])
        for e, saved in zip(ctx.eager or [], sd["eager"]):
            e.load_state_dict(saved)
        optimizer_state_from_local(ctx.optimizer, sd["optimizer"])
        ctx.state.load_state_dict(sd["position"])
        self.sync.load_heal_state_dict(sd)
        ctx.evidence.event("healed", round=ctx.state.round, step=ctx.state.step)
        log.info("group %d rank %d healed from a peer: fragment rounds %s, inner step %d", ctx.spec.group, ctx.world.rank,
                 ctx.state.rounds, ctx.state.step)

    # --- evidence for tests and debugging (only with a report dir) ----------------------------------

    def record_step(self, healed: bool) -> None:
        ctx = self.ctx
        if not ctx.evidence.enabled:
            return
        s = ctx.state
        opt = [v.to_local() if hasattr(v, "to_local") else v for st in ctx.optimizer.state.values() for k, v in sorted(st.items()) if k != "step"]
        # An event, not just the summary: a SIGKILLed rank leaves its events behind.
        ctx.evidence.event(
            "step", step=ctx.replicas.step(), round=s.round, pos=s.step, healed=healed,
            model=digest(ctx.local.values()), globals=digest(ctx.global_shard.values()), optimizer=digest(opt),
        )

    def write_evidence(self) -> None:
        ctx = self.ctx
        summary = {
            "group": ctx.spec.group, "rank": ctx.world.rank, "world_size": ctx.world.world_size,
            "state": dataclasses.asdict(ctx.state), "healed_steps": ctx.replicas.healed_steps, "takeovers": self.sync.takeovers,
            "ranges": [dataclasses.astuple(r) for r in self.shard.ranges], "full_model_fp32_bytes": 4 * ctx.manifest.total_numel(),
            "shard_fp32_bytes": 4 * self.shard.numel(), "memory": self.sync.memory, "losses": [x for x in self.sync.losses if math.isfinite(x)],
        }
        tensors = {"model": {n: t.detach().cpu().clone() for n, t in ctx.local.items()},
                   "global": {n: t.view(-1) for n, t in ctx.global_shard.items()}}
        ctx.evidence.write(summary, tensors)
