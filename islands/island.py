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
exchanges in flight. The island's side of the round (when one ends, the
exchange, the landing, a resync, the finish) is one object it owns, `self.sync`:
islands/round.py's IslandRound; the loop below is the schedule that calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from diloco.wire.feedback import ErrorFeedback
from diloco.config import RunConfig
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.shardmap import model_checksum
from diloco.streaming import EagerState
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, downlink_codec, link_codecs, uplink_codec
from islands.client import CoordinatorClient
from islands.evidence import Evidence, digest
from islands.feed import make_feed
from islands.fsdp import ShardLayout, build_island_model, local_views
from islands.joining import check_join_reply
from islands.memwatch import PeakRss
from islands.outcome import Next
from islands.replicas import Replicas, Solo
from islands.round import FragmentShard, IslandRound, Wire
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


class Island:
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
        self.eager = [EagerState(cfg.outer) for _ in range(p)] if cfg.streaming.eager else None
        self.replicas: Solo | Replicas = Solo()
        wire = Wire(client, self.codec, joined.max_chunk_bytes, self.feedback, cfg.rounds.deadline_s + 60,
                    lambda: self.state.island_id, link_codecs(cfg.wire))  # compression per link: what it may push with
        self.restored = False
        self.checkpoint = None  # islands.checkpoint.IslandCheckpoint with --checkpoint
        self.cores = None  # islands.cores.CoreShare: on the CPU without --threads, re-shared every round
        # Inner steps; blocked waiting for results (of which: for other islands' pushes); everything.
        self.timing = {"compute_s": 0.0, "wait_s": 0.0, "straggler_s": 0.0, "wall_s": 0.0}
        self.losses: list[float] = []  # mean inner loss of each H steps
        self.exchanges: list[dict] = []  # one record per landed exchange
        self.step_spans: list[tuple[float, float]] | None = None  # set to [] to record each inner step's span
        self.memory: list[dict] = []
        self.evidence = Evidence(self.spec.report_dir, self.spec.group, world.rank)
        self.telemetry = IslandTelemetry()  # what it writes: islands/launch.py's run_island (--metrics-port, --log-url)
        # The island's side of the round: when one ends, the exchange, the landing, a resync, the finish.
        self.sync = IslandRound(
            cfg, self.spec, world, client, self.state, self.layout, self.total_rounds,
            params=FragmentShard(-1, self.manifest, self.shard.ranges, self.whole, self.local, self.global_shard),
            fragments=self.fragments, wire=wire, down=self.down, feedback=self.feedback, eager=self.eager,
            replicas=self.replicas, group_reduce=self.group_reduce, reset_training=self.reset_training,
            leased=self.feed.leased, evidence=self.evidence, timing=self.timing, records=self.exchanges,
        )

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
            clock = self.sync.clock_extra()  # time-boxed rounds: the groups agree on the round's clock
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
                    self.sync.resync(f, Next.RESYNC)
            return None
        if self.spec.groups > 1:
            self.sync.agree_clock(clock)
        return loss

    def reset_training(self) -> None:
        """Our training diverged (a push refused as not finite): a fresh inner optimizer and error feedback."""
        self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
        if self.feedback is not None:
            self.feedback.reset()

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
                self.sync.round_begins(f)  # the time box counts from the round's first inner step
        loss = train_step(self.model, self.optimizer, batch, inner_lr(self.sync.lr_step(), total_steps, cfg), cfg.grad_clip,
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
        if not self.sync.pace.custom and s.step % cfg.steps_per_round == 0:
            self._close_window()

    def _close_window(self) -> None:
        """The mean inner loss of the round's steps (every H steps; at each sync with a pace of the island's own)."""
        if not self._window:
            return
        s = self.state
        self.losses.append(sum(self._window) / len(self._window))
        self._window = []
        if self.cores is not None:  # islands that started or ended on this machine since move our share
            self.cores.apply()
        log.info("%s step %d: train loss %.4f, fragment rounds %s; %.1fs in inner steps, %.1fs waiting so far",
                 s.island_id, s.step, self.losses[-1], s.rounds, self.timing["compute_s"], self.timing["wait_s"])

    # --- a boundary step: the schedule of the fragments' exchanges -----------------------------------

    def _boundary(self) -> bool:
        """Lands an exchange that is due, or begins the syncs that are due. True when this step's commit was used.
        Time-boxed with fragments, a due push goes first: it never waits behind a landing."""
        s, sync = self.state, self.sync
        sync_first = sync.pace.time_boxed and len(self.fragments) > 1
        if not sync_first and sync.land_due():
            return True
        for f in range(len(self.fragments)):
            if f in sync.inflight or s.rounds[f] >= s.stop_round or s.finished:
                continue
            if sync.round_over(f):
                meter = PeakRss() if self.spec.measure_memory else nullcontext()
                with meter:
                    round_ = s.rounds[f]
                    if sync.pace.custom:
                        self._close_window()
                    sync.begin(f)
                    if sync.inflight[f].due > s.step:
                        return False
                    sync.land(f)
                if isinstance(meter, PeakRss) and meter.peak_bytes is not None:
                    self.memory.append({"round": round_, "fragment": f, "peak_rss_bytes": meter.peak_bytes, "phases": meter.phases})
                return True
        return sync_first and sync.land_due()

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
        self.sync.start(self.restored)
        s, h = self.state, self.cfg.inner.steps_per_round
        if max_rounds is not None:
            s.stop_round = min(s.stop_round, min(s.rounds) + max_rounds)
        if self.spec.groups > 1:
            self.replicas = Replicas(
                self.spec.ft, self.spec.group, self.world.rank, self.world.world_size, self.world.device,
                f"{self.spec.key}.group{self.spec.group}", self.heal_state_dict, self.load_heal_state_dict,
            )
            self.sync.use_replicas(self.replicas)
        self._participants, self._window = 1, []
        total_steps = self.total_rounds * h
        # Steady state (LeaveRequest): between fixed steps of the fixed schedule; none with a pace of the island's own.
        marks = {h: None, total_steps - h: None} if self.total_rounds >= 3 and not self.sync.pace.custom else {}
        self.evidence.event("up", round=s.round)
        matches, finishing = None, 0
        assemble_until = time.monotonic() + self.spec.ft.startup_wait_s
        try:
            while True:
                replaced = getattr(self.client, "replaced", None)
                if replaced is not None:  # another process joined as this island (its heartbeat was refused REPLACED)
                    raise replaced
                healed = self.replicas.start_step()
                self.record_step(healed)
                if self.replicas.participants() < self.spec.groups and time.monotonic() < assemble_until and not healed:
                    # Starting together: wait (bounded) for every group, so that all of them train
                    # from the first step instead of the late ones healing in later.
                    self.replicas.commit()
                    time.sleep(0.1)
                    continue
                assemble_until = 0.0
                if self.checkpoint is not None and not self.sync.inflight:
                    self.checkpoint.maybe_save(self)
                if s.done() and not self.sync.inflight:
                    self._close_timing(marks, started)
                    finishing += 1
                    matches = self.sync.finish(last_try=finishing >= 5)
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
        # The run's checksum (diloco/shardmap.py join_checksums), the same on every rank: a rank holding the whole model
        # computes it (a sharded coordinator's parts joined), the others take the one the coordinator confirmed at leave.
        whole = (model_checksum(dict(self.model.named_parameters()), getattr(self.client, "map", None)) if self.whole
                 else self.world.broadcast_object(self.sync.final_checksum))
        return IslandResult(
            s.island_id, s.rounds_done, s.round, whole, bool(matches), self.losses, self.timing["compute_s"],
            self.timing["wait_s"], self.timing["wall_s"], s.step, self.timing["straggler_s"], self.sync.late_folds,
        )

    # --- healing: what a restarted group receives from a live peer -----------------------------------

    def heal_state_dict(self) -> dict:
        from islands.fsdp import optimizer_state_to_local

        return {
            "model": {n: t.detach() for n, t in self.local.items()},
            "optimizer": optimizer_state_to_local(self.optimizer),
            "global": self.global_shard,
            "feedback": self.feedback.state_dict() if self.feedback is not None else {},
            "eager": [e.state_dict() for e in self.eager] if self.eager is not None else [],
            "position": self.state.state_dict(),
            **self.sync.heal_state_dict(),  # the exchanges in flight and the round's clock
        }

    @torch.no_grad()
    def load_heal_state_dict(self, sd: dict) -> None:
        from islands.fsdp import optimizer_state_from_local

        for name, t in sd["model"].items():
            self.local[name].copy_(t)
        for name, t in sd["global"].items():
            self.global_shard[name].copy_(t)
        if self.feedback is not None:
            self.feedback.load_state_dict(sd["feedback"])
        for e, saved in zip(self.eager or [], sd["eager"]):
            e.load_state_dict(saved)
        optimizer_state_from_local(self.optimizer, sd["optimizer"])
        self.state.load_state_dict(sd["position"])
        self.sync.load_heal_state_dict(sd)
        self.evidence.event("healed", round=self.state.round, step=self.state.step)
        log.info("group %d rank %d healed from a peer: fragment rounds %s, inner step %d", self.spec.group, self.world.rank,
                 self.state.rounds, self.state.step)

    # --- evidence for tests and debugging (only with a report dir) ----------------------------------

    def record_step(self, healed: bool) -> None:
        if not self.evidence.enabled:
            return
        s = self.state
        opt = [v.to_local() if hasattr(v, "to_local") else v for st in self.optimizer.state.values() for k, v in sorted(st.items()) if k != "step"]
        # An event, not just the summary: a SIGKILLed rank leaves its events behind.
        self.evidence.event(
            "step", step=self.replicas.step(), round=s.round, pos=s.step, healed=healed,
            model=digest(self.local.values()), globals=digest(self.global_shard.values()), optimizer=digest(opt),
        )

    def write_evidence(self) -> None:
        summary = {
            "group": self.spec.group, "rank": self.world.rank, "world_size": self.world.world_size,
            "state": dataclasses.asdict(self.state), "healed_steps": self.replicas.healed_steps, "takeovers": self.sync.takeovers,
            "ranges": [dataclasses.astuple(r) for r in self.shard.ranges], "full_model_fp32_bytes": 4 * self.manifest.total_numel(),
            "shard_fp32_bytes": 4 * self.shard.numel(), "memory": self.memory, "losses": [x for x in self.losses if math.isfinite(x)],
        }
        tensors = {"model": {n: t.detach().cpu().clone() for n, t in self.local.items()},
                   "global": {n: t.view(-1) for n, t in self.global_shard.items()}}
        self.evidence.write(summary, tensors)
