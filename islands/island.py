"""The island: one loop for every kind, from one rank to R replica groups x N FSDP ranks.

A one-rank island is the small case of the same thing: a world of one rank
(the model unsharded) in a solo replica group (no torchft). Every iteration of
the loop is one step, taken by the replica groups in lock step through torchft
(islands/replicas.py), whose quorum may heal a restarted group. A step is
either boundary work or an inner step:

- boundary: a fragment's exchange that is due lands (the groups agree on the
  push outcome, every rank pulls its ranges, the result is mixed in), or a
  fragment whose round ends starts its exchange (islands/exchange.py):
  blocking with tau = 0 (plain DiLoCo), overlapped with tau > 0 (Streaming
  DiLoCo: it lands tau inner steps later while training goes on);
- inner step: the batch of inner step c (a pure function of island, rank and
  c), gradients averaged across the groups, the optimizer steps only if the
  step commits, else the same step is redone.

Fragments (diloco/fragments.py) split the model; without streaming there is one,
which syncs every H inner steps. The island's position (IslandState) is what a
checkpoint writes and a healing group receives, with the model shard, inner
optimizer state, theta_global shard, error feedback, eager state and the
exchanges in flight. Landing, resync and finishing: islands/landing.py.
"""

from __future__ import annotations

import logging
import math
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diloco.feedback import ErrorFeedback
from diloco.config import RunConfig
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.params import checksum
from diloco.streaming import EagerState, eager_gradient, mix_
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, downlink_codec, link_codecs, uplink_codec
from islands import exchange
from islands.client import CoordinatorClient, MeanBuffer
from islands.evidence import Evidence, maybe_fault
from islands.exchange import Exchange, FragmentShard, Wire
from islands.feed import make_feed
from islands.fsdp import ShardLayout, build_island_model, local_views
from islands.joining import check_join_reply
from islands.landing import Landing
from islands.memwatch import PeakRss
from islands.pace import Pacing, RoundPace
from islands.replicas import Replicas, Solo
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


class Island(Landing, Pacing):
    def __init__(self, cfg: RunConfig, world: IslandWorld, client: CoordinatorClient, joined: pb.JoinResponse,
                 spec: ReplicaSpec | None = None, compile_model: bool = False):
        self.cfg, self.world, self.client = cfg, world, client
        self.spec = spec or ReplicaSpec()
        self.codec, self.down = uplink_codec(cfg.wire), downlink_codec(cfg.wire)
        client.codecs[self.down.name] = self.down
        self.manifest = Manifest.from_proto(joined.parameters)
        self.total_rounds = joined.total_rounds
        self.model = build_island_model(cfg.model, world.device, world.world_size, compile_model)
        self.layout = check_join_reply(joined, cfg, Manifest.of(dict(self.model.named_parameters())))
        self.shard = ShardLayout.of(self.model)
        self.whole = world.world_size == 1  # the rank holds the whole model
        self.local = local_views(self.model)
        # theta_global stays in fp32 on the CPU: the outer step never needs it on the GPU.
        self.global_shard = ({n: torch.zeros(s, dtype=torch.float32) for n, s in self.manifest.shapes.items()}
                             if self.whole else self.shard.zeros())
        self.optimizer = build_inner_optimizer(self.model, cfg.inner)
        self.feedback = (ErrorFeedback({r.name: r.numel for r in self.shard.ranges}, cfg.wire.decay, cfg.wire.feedback_in_model)
                         if cfg.wire.uses_error_feedback else None)
        self.fragments = [self._fragment_shard(f.index, f.names) for f in self.layout]
        p = len(self.fragments)
        self.state = IslandState(joined.island_id, list(joined.fragment_rounds) or [joined.round] * p, joined.total_rounds)
        self.feed = make_feed(cfg, joined, world, self.spec, client, lambda: self.state.island_id)
        self.tau, self.alpha = cfg.streaming.overlap, cfg.streaming.alpha
        # When a round ends (islands/pace.py); a time box does not count the time blocked on a result.
        self.pace = RoundPace(cfg, self.spec.steps_per_round, blocked=lambda: self.timing["wait_s"])
        self.agreed_clock: tuple[int, list[float]] = (-1, [])  # (step, fragment clocks) every rank and group agreed on
        self.late_folds = 0
        self.eager = [EagerState(cfg.outer) for _ in range(p)] if cfg.streaming.eager else None
        self.inflight: dict[int, Exchange] = {}
        self.replicas: Solo | Replicas = Solo()
        self.wire = Wire(client, self.codec, joined.max_chunk_bytes, self.feedback, cfg.rounds.deadline_s + 60,
                         lambda: self.state.island_id, link_codecs(cfg.wire))  # compression per link: what it may push with
        self.restored = False
        self.checkpoint = None  # islands.checkpoint.IslandCheckpoint with --checkpoint
        # Inner steps; blocked waiting for results (of which: for other islands' pushes); everything.
        self.timing = {"compute_s": 0.0, "wait_s": 0.0, "straggler_s": 0.0, "wall_s": 0.0}
        self.losses: list[float] = []  # mean inner loss of each H steps
        self.exchanges: list[dict] = []  # one record per landed exchange
        self.step_spans: list[tuple[float, float]] | None = None  # set to [] to record each inner step's span
        self.memory: list[dict] = []
        self.takeovers = 0
        self.evidence = Evidence(self.spec.report_dir, self.spec.group, world.rank)
        self.telemetry = IslandTelemetry()  # what it writes: islands/launch.py's run_island (--metrics-port, --log-url)

    def _fragment_shard(self, index: int, names: tuple[str, ...]) -> FragmentShard:
        return FragmentShard(
            index, Manifest({n: self.manifest.shapes[n] for n in names}), [r for r in self.shard.ranges if r.name in names],
            self.whole, {n: self.local[n] for n in names}, {n: self.global_shard[n] for n in names},
        )

    @property
    def island_id(self) -> str:
        return self.state.island_id

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        return self.global_shard

    # --- inside the island: its group's ranks, and the replica groups -------------------------

    def group_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.world.device)
        if self.world.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def _rounds_tag(self) -> float:
        """The fragments' rounds as one small whole number (below 4093, so its square is exact in fp32):
        groups that disagree on any of them are caught (up to a 1-in-4093 collision of the tags)."""
        return float(zlib.crc32(repr(self.state.rounds).encode()) % 4093)

    def _reduce_gradients(self, model: torch.nn.Module, loss: float) -> float | None:
        """Averages the local gradient shards (and the loss) across the groups; None if the step did not commit.

        The rounds ride along: if the groups disagree on them, in every group
        mean(r) != r or mean(r^2) != r^2, nobody commits, and each resyncs.
        """
        disagree = False
        if self.spec.groups > 1:
            from islands.fsdp import local_grads

            grads = list(local_grads(model))
            r = self._rounds_tag()
            clock = self._clock_extra()  # time-boxed rounds: the groups agree on the round's clock (islands/pace.py)
            extra = torch.tensor([loss, r, r * r, *clock], dtype=grads[0].dtype, device=grads[0].device)
            expected = extra[1:3].tolist()  # as the collective's dtype holds them
            flat = torch.cat(grads + [extra])
            self.replicas.allreduce_(flat)
            loss, mean_r, mean_r2, *clock = flat[-extra.numel():].tolist()
            disagree = [mean_r, mean_r2] != expected
            if disagree:
                self.replicas.report_error(RuntimeError("replica groups are in different rounds"))
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()])
                offset += g.numel()
        self._participants = self.replicas.participants()
        if not self.replicas.commit():
            log.warning("group %d: inner step %d did not commit; redoing it", self.spec.group, self.state.step)
            if disagree:
                for f in range(len(self.fragments)):
                    self.resync(f, exchange.LOST)
            return None
        if self.spec.groups > 1:
            self._agree_clock(clock)
        return loss

    # --- one inner step ---------------------------------------------------------------------------

    def _inner_step(self) -> None:
        cfg, s = self.cfg.inner, self.state
        total_steps = self.total_rounds * cfg.steps_per_round
        batch = self.feed.batch(s, self.replicas.participating_rank(), self.replicas.participants())
        if self.world.device.type == "cuda":
            # Charge this step only, not GPU work queued before it (a landing's copies into the model).
            torch.cuda.synchronize(self.world.device)
        t0 = time.monotonic()
        for f in range(len(self.fragments)):
            if s.step == s.last_sync[f]:
                self.pace.begin_round(f)  # the time box counts from the round's first inner step
        loss = train_step(self.model, self.optimizer, batch, inner_lr(self._lr_step(), total_steps, cfg), cfg.grad_clip,
                          self._reduce_gradients, self.world.device, autocast=self.whole)
        if self.spec.throttle_s:
            time.sleep(self.spec.throttle_s)  # a slower device, emulated: counted as compute
        t1 = time.monotonic()
        if loss is None:
            return
        self.timing["compute_s"] += t1 - t0
        if self.step_spans is not None:
            self.step_spans.append((t0, t1))
        tokens = self._participants * self.world.world_size * cfg.batch_size * self.cfg.data.seq_len
        for f in range(len(self.fragments)):
            s.loss[f][0] += loss
            s.loss[f][1] += 1
            s.tokens[f] += tokens
        s.step += 1
        s.consume(self.feed.samples_per_step(self._participants))
        self.telemetry.inner_step(loss, tokens, t1 - t0)
        self._window.append(loss)
        if not self.pace.custom and s.step % cfg.steps_per_round == 0:
            self._close_window()

    def _close_window(self) -> None:
        """The mean inner loss of the round's steps (every H steps; at each sync with a pace of the island's own)."""
        if not self._window:
            return
        s = self.state
        self.losses.append(sum(self._window) / len(self._window))
        self._window = []
        log.info("%s step %d: train loss %.4f, fragment rounds %s; %.1fs in inner steps, %.1fs waiting so far",
                 s.island_id, s.step, self.losses[-1], s.rounds, self.timing["compute_s"], self.timing["wait_s"])

    # --- a fragment's sync: the push now, the landing tau inner steps later ---------------------

    @torch.no_grad()
    def _sync(self, f: int) -> None:
        s, shard = self.state, self.fragments[f]
        c, h = s.step, self.cfg.inner.steps_per_round
        last = s.rounds[f] >= self.total_rounds - 1 if self.pace.custom else c >= self.total_rounds * h
        background = self.tau > 0 and not last
        if self.pace.custom:
            self._close_window()
        steps = c - s.last_sync[f]
        if steps <= 0:
            log.warning("%s: fragment %d is due with no inner step trained for it; pushing it with no weight", s.island_id, f)
        loss_sum, n = self.group_reduce([s.loss[f][0], s.loss[f][1]])
        ex = Exchange(
            f, s.rounds[f], c, c + self.tau if background else c, tokens=s.tokens[f],
            inner_steps=max(steps, 1), train_loss=loss_sum / n if n else 0.0, checksum=s.checksums[f],
            pusher=self.replicas.participating_rank() == 0, samples=s.positions(s.data_marks[f], s.data_cursor),
            first_step=s.rounds[f] * h if self.pace.custom else -1,  # where its lr positions start (diloco/pace.py)
            codec=s.codecs[f],  # compression per link: as last advised, fixed for this push
        )
        if background:
            ex.pg = {r.name: shard.flat_global(r.name) - shard.local[r.name].to("cpu", torch.float32) for r in shard.ranges}
            ex.staging = {n_: g.clone() for n_, g in shard.global_.items()}
        eager = self.eager[f] if self.eager is not None else None
        if eager is not None and background:
            ex.mean = MeanBuffer({n_: torch.zeros_like(t) for n_, t in ex.pg.items()}, shard.manifest, self.down, shard.wire_ranges)
            if eager.prev_mean is not None:
                ex.estimate = eager.replica.step(shard.flat, eager_gradient(eager.prev_mean, eager.prev_own, ex.pg, eager.share))
                mix_(shard.local, ex.estimate, self.alpha)
        log.debug("%s: fragment %d round %d pushes %d tokens of %d inner steps", s.island_id, f, ex.round, ex.tokens, ex.inner_steps)
        s.restart_fragment(f)
        self.pace.synced(f)  # its next time box is a whole round_s (islands/pace.py)
        self.inflight[f] = ex
        if ex.pusher:  # tests: a pusher dying mid-push, or pushing late
            maybe_fault("die-before-push", self.spec.group, self.world.rank, ex.round)
            maybe_fault("hold-before-push", self.spec.group, self.world.rank, ex.round)
        exchange.start(shard, ex, self.wire)

    def _boundary(self) -> bool:
        """Lands an exchange that is due, or starts the syncs that are due. True when this step's commit was used.
        Time-boxed with fragments, a due push goes first: it never waits behind a landing (islands/pace.py)."""
        s = self.state
        sync_first = self.pace.time_boxed and len(self.fragments) > 1
        if not sync_first and self._land_due():
            return True
        for f, shard in enumerate(self.fragments):
            if f in self.inflight or s.rounds[f] >= s.stop_round or s.finished:
                continue
            if self._round_over(f):
                meter = PeakRss() if self.spec.measure_memory else nullcontext()
                with meter:
                    round_ = s.rounds[f]
                    self._sync(f)
                    if self.inflight[f].due > s.step:
                        return False
                    self.land(f)
                if isinstance(meter, PeakRss) and meter.peak_bytes is not None:
                    self.memory.append({"round": round_, "fragment": f, "peak_rss_bytes": meter.peak_bytes, "phases": meter.phases})
                return True
        return sync_first and self._land_due()

    def _land_due(self) -> bool:
        for f in sorted(self.inflight):
            if self.inflight[f].due <= self.state.step or self.state.done():
                return self.land(f) or True
        return False

    def _close_timing(self, marks: dict, started: float) -> None:
        self.timing["wall_s"] = time.monotonic() - started
        if marks and all(marks.values()):
            h = self.cfg.inner.steps_per_round
            (c0, t0), (c1, t1) = marks[h], marks[self.total_rounds * h - h]
            self.timing["steady_compute_s"], self.timing["steady_wall_s"] = c1 - c0, t1 - t0

    # --- the loop ----------------------------------------------------------------------------------

    def run(self, max_rounds: int | None = None) -> IslandResult:
        started = time.monotonic()
        self.telemetry.attach(self)
        self.start()
        s, h = self.state, self.cfg.inner.steps_per_round
        if max_rounds is not None:
            s.stop_round = min(s.stop_round, min(s.rounds) + max_rounds)
        if self.spec.groups > 1:
            self.replicas = Replicas(
                self.spec.ft, self.spec.group, self.world.rank, self.world.world_size, self.world.device,
                f"{self.spec.key}.group{self.spec.group}", self.heal_state_dict, self.load_heal_state_dict,
            )
        self._participants, self._window = 1, []
        total_steps = self.total_rounds * h
        # Steady state (LeaveRequest): between fixed steps of the fixed schedule; none with a pace of the island's own.
        marks = {h: None, total_steps - h: None} if self.total_rounds >= 3 and not self.pace.custom else {}
        self.evidence.event("up", round=s.round)
        matches, finishing = None, 0
        assemble_until = time.monotonic() + self.spec.ft.startup_wait_s
        try:
            while True:
                healed = self.replicas.start_step()
                self.record_step(healed)
                if self.replicas.participants() < self.spec.groups and time.monotonic() < assemble_until and not healed:
                    # Starting together: wait (bounded) for every group, so that all of them train
                    # from the first step instead of the late ones healing in later.
                    self.replicas.commit()
                    time.sleep(0.1)
                    continue
                assemble_until = 0.0
                if self.checkpoint is not None and not self.inflight:
                    self.checkpoint.maybe_save(self)
                if s.done() and not self.inflight:
                    self._close_timing(marks, started)
                    finishing += 1
                    matches = self.finish(last_try=finishing >= 5)
                    if matches is not None:
                        break
                    continue
                if self._boundary():
                    self.telemetry.landed(self)
                    continue
                if s.step in marks and marks[s.step] is None:
                    marks[s.step] = (self.timing["compute_s"], time.monotonic())
                self._inner_step()
        finally:
            self.telemetry.finish()
            self.write_evidence()
            self.replicas.shutdown()
        whole = checksum(dict(self.model.named_parameters())) if self.whole else self.final_checksum
        return IslandResult(
            s.island_id, s.rounds_done, s.round, whole, bool(matches), self.losses, self.timing["compute_s"],
            self.timing["wait_s"], self.timing["wall_s"], s.step, self.timing["straggler_s"], self.late_folds,
        )
