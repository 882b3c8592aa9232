"""An island of R replica groups x N FSDP ranks; every rank pushes and pulls only its own shard.

Every iteration of the loop is one torchft step, taken in lock step by the
groups (islands/replicas.py): its quorum may heal a restarted group, and then

- pos < H: an inner step. Gradients are reduce-scattered inside the group by
  FSDP and averaged across the groups; the optimizer steps only if the step
  commits, else the same step (same batch) is redone.
- pos == H: the exchange. All groups compute the same pseudo-gradient of their
  shards (theta_global - theta_local, fp32, one chunk at a time). The group
  with rank 0 in the quorum pushes: each of its ranks streams its own shard,
  addressed by name and flat offset, over its own connection; the coordinator
  counts the contribution once every element arrived exactly once. The push
  outcome is then shared across the groups and the step must commit. If the
  pushing group died, the step does not commit and is redone: the next
  quorum's rank-0 group takes the push over. A shard its predecessor already
  delivered is refused as a duplicate, which counts as delivered: the groups'
  pseudo-gradients are bit-identical, so it does not matter whose copy arrived.
  Then every rank of every group pulls the new global values of just its
  ranges and checks them against the coordinator's checksum of those ranges.

No rank ever holds the full model: not in training (FSDP), not in the outer
step (one chunk at a time), not at start (built on the meta device, each rank
fetches its shard).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from collections.abc import Iterator
from contextlib import nullcontext

import grpc
import torch
import torch.distributed as dist

from diloco.config import RunConfig
from diloco.data import StepIndexedStream
from diloco.inner import build_inner_optimizer, inner_lr
from diloco.params import ranges_checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, downlink_codec, uplink_codec
from islands.client import CoordinatorClient, RegeneratingChunks
from islands.evidence import Evidence, digest, maybe_fault
from islands.fsdp import (
    ShardLayout, build_sharded_model, local_grads, local_views, optimizer_state_from_local, optimizer_state_to_local,
)
from islands.joining import check_join_reply
from islands.memwatch import PeakRss
from islands.outcome import Next, next_step, reason_name
from islands.replicas import Replicas, Solo
from islands.shard_state import Position, ReplicaSpec, ShardFeedback
from islands.world import IslandWorld

log = logging.getLogger(__name__)

# Push outcomes, shared across the groups (the worst one wins inside a group).
NOBODY, PUSHED, LOST, DIVERGED, UNKNOWN = 0, 1, 2, 3, 4


class ShardedIsland:
    def __init__(self, cfg: RunConfig, world: IslandWorld, spec: ReplicaSpec, client: CoordinatorClient, joined: pb.JoinResponse):
        self.cfg, self.world, self.spec, self.client = cfg, world, spec, client
        self.manifest = Manifest.from_proto(joined.parameters)
        self.codec = uplink_codec(cfg.wire)
        client.codecs[downlink_codec(cfg.wire).name] = downlink_codec(cfg.wire)
        self.chunk_bytes = joined.max_chunk_bytes
        self.total_rounds = joined.total_rounds
        self.model, _ = build_sharded_model(cfg.model, world.device, world.world_size)
        check_join_reply(joined, cfg, Manifest.of(dict(self.model.named_parameters())))
        self.layout = ShardLayout.of(self.model)
        self.local = local_views(self.model)
        self.global_shard = self.layout.zeros()  # this rank's part of theta_global, fp32 on the CPU
        self.optimizer = build_inner_optimizer(self.model, cfg.inner)
        slots = spec.groups * world.world_size
        slot = spec.group * world.world_size + world.rank
        self.data = StepIndexedStream(cfg.data, cfg.seed, joined.shard_index * slots + slot, cfg.data.shards * slots)
        self.feedback = (ShardFeedback(self.layout, cfg.wire.decay, cfg.wire.feedback_in_model)
                         if cfg.wire.uses_error_feedback else None)
        self.carried = 0.0  # sum |residual| kept in the local shard at the last adoption (feedback_in_model)
        self.state = Position(joined.island_id, joined.round, stop_round=joined.total_rounds)
        self.replicas: Solo | Replicas = Solo()
        self.losses: list[float] = []
        self.memory: list[dict] = []
        self.takeovers = 0
        self.evidence = Evidence(spec.report_dir, spec.group, world.rank)
        self.checkpoint = None  # islands.shard_checkpoint.ShardCheckpoint with --checkpoint

    # --- inside the replica group -------------------------------------------------

    def _group_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.world.device)
        if self.world.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def _join_again(self) -> None:
        """Rank 0 rejoins under the island key (the coordinator forgot us); the group learns the id."""
        joined = self.client.join(self.cfg.digest(), self.codec.name, self.state.island_id, self.spec.key) if self.world.is_leader else None
        self.state.island_id = self.world.broadcast_object(joined.island_id if joined else None)

    # --- healing: what a restarted group receives from a live peer --------------------

    def state_dict(self) -> dict:
        return {
            "model": {n: t.detach() for n, t in self.local.items()},
            "optimizer": optimizer_state_to_local(self.optimizer),
            "global": self.global_shard,
            "feedback": self.feedback.committed if self.feedback is not None else {},
            "position": dataclasses.asdict(self.state),
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        for name, t in sd["model"].items():
            self.local[name].copy_(t)
        for name, t in sd["global"].items():
            self.global_shard[name].copy_(t)
        if self.feedback is not None:
            for name, t in sd["feedback"].items():
                self.feedback.committed[name].copy_(t)
        optimizer_state_from_local(self.optimizer, sd["optimizer"])
        self.state = Position(**sd["position"])
        self.evidence.event("healed", round=self.state.round, pos=self.state.pos)
        log.info("group %d rank %d healed from a peer: round %d, step %d of the round", self.spec.group, self.world.rank, self.state.round, self.state.pos)

    # --- the coordinator: fetch, push, pull -----------------------------------------

    @torch.no_grad()
    def _adopt(self, header: pb.ResultHeader, pushed: bool = False) -> None:
        """theta_local <- theta_global for this shard (the inner optimizer state is kept); after our own
        push with wire.feedback_in_model, less the residual, except when the run ends (the island ends
        holding exactly theta_global)."""
        for name, t in self.global_shard.items():
            self.local[name].copy_(t)
        s = self.state
        self.carried = 0.0
        if pushed and self.feedback is not None and self.feedback.in_model and not (
                header.run_finished or header.round >= s.stop_round):
            self.feedback.keep_residual_(self.local)
            self.carried = torch.stack([t.abs().sum() for t in self.feedback.committed.values()]).sum().item()
        self.state = Position(
            s.island_id, header.round, s.stop_round, checksum=header.checksum, ranges_checksum=header.ranges_checksum,
            finished=header.run_finished, rounds_done=s.rounds_done,
        )

    def _fetch(self) -> None:
        """Every rank fetches the current values of its ranges; repeated until the group agrees on the round."""
        for _ in range(5):
            header = self.client.fetch(self.state.island_id, self.global_shard, self.manifest, self.layout.ranges)
            lo, hi = self._group_reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                self._adopt(header)
                return
            log.warning("ranks fetched different rounds (%d..%d); fetching again", -lo, hi)
        raise RuntimeError("the group's ranks could not fetch the same round of global parameters; is the coordinator restarting?")

    def _chunks(self, start: int = 0) -> Iterator[pb.TensorChunk]:
        """The pseudo-gradient of this shard as chunks, computed one chunk at a time; a pure function."""
        step = max(1, self.codec.max_elements(self.chunk_bytes))
        i = 0
        for r in self.layout.ranges:
            g, local = self.global_shard[r.name], self.local[r.name]
            for lo in range(0, r.numel, step):
                hi = min(lo + step, r.numel)
                if i >= start:
                    with torch.no_grad():  # runs on gRPC's thread, where grad mode is on
                        piece = g[lo:hi] - local[lo:hi].to("cpu", torch.float32)
                        if self.feedback is not None:
                            payload = self.feedback.encode(r.name, lo, hi, piece, self.codec)
                        else:
                            payload = self.codec.encode(piece)
                    yield pb.TensorChunk(name=r.name, offset=r.offset + lo, numel=hi - lo, payload=payload, crc32=zlib.crc32(payload))
                i += 1

    def _push(self, train_loss: float) -> int:
        s = self.state
        header = pb.PushHeader(
            island_id=s.island_id, round=s.round, tokens=s.tokens, train_loss=train_loss, codec=self.codec.name,
            inner_steps=self.cfg.inner.steps_per_round, global_checksum=s.checksum,
        )
        if self.layout.numel() == 0:
            return PUSHED
        maybe_fault("die-before-push", self.spec.group, self.world.rank, s.round)
        try:
            self.client.push(header, RegeneratingChunks(self._chunks))
            return PUSHED
        except grpc.RpcError as e:
            step = next_step(e)
            if step is Next.DELIVERED:
                log.info("group %d rank %d: shard already delivered by another group; taking over the rest", self.spec.group, self.world.rank)
                self.takeovers += 1
                self.evidence.event("takeover", round=s.round)
                return PUSHED
            if step is Next.RESET:
                return DIVERGED
            if step is Next.REJOIN:
                return UNKNOWN
            if step in (Next.RESYNC, Next.PUSH_AGAIN, Next.FINISHED):
                log.warning("%s: push for round %d refused: %s: %s", s.island_id, s.round, reason_name(e), e.details())
                return LOST
            raise

    def _pull(self) -> None:
        """Every rank pulls its ranges of the round's result; any rank's trouble makes the whole group fetch."""
        s = self.state
        header, trouble = None, 0  # 0: fine, 1: fetch the values, 2: rejoin first
        while header is None and not trouble:
            try:
                header = self.client.pull(
                    s.island_id, s.round, self.global_shard, self.manifest, s.checksum,
                    timeout_s=self.cfg.rounds.deadline_s + 60, ranges=self.layout.ranges,
                )
            except grpc.RpcError as e:
                step = next_step(e)
                if step is Next.WAIT:
                    continue  # the round waits for slower islands: so do we
                if step not in (Next.RESYNC, Next.PUSH_AGAIN, Next.REJOIN, Next.FINISHED):
                    raise
                log.warning("%s rank %d: pull of round %d failed (%s: %s)", s.island_id, self.world.rank, s.round, reason_name(e), e.details())
                trouble = 2 if step is Next.REJOIN else 1
        got = header.round if header is not None else -1
        trouble, lo, hi = self._group_reduce([trouble, -got, got], dist.ReduceOp.MAX)
        if trouble or -lo != hi:
            self._resync(UNKNOWN if trouble == 2 else LOST)
            return
        self._adopt(header, pushed=True)

    def _resync(self, why: int) -> None:
        """The round went on without us (or our copy drifted): fetch the current values and train for that round."""
        log.warning("%s group %d: resync after round %d (outcome %d)", self.state.island_id, self.spec.group, self.state.round, why)
        if why == UNKNOWN:
            self._join_again()
        if why == DIVERGED:
            self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
            if self.feedback is not None:
                self.feedback.reset()
        self._fetch()

    # --- one step of the loop ------------------------------------------------------

    def _inner_step(self) -> None:
        cfg, s = self.cfg.inner, self.state
        step = s.round * cfg.steps_per_round + s.pos
        inputs, targets = (t.to(self.world.device) for t in self.data.batch_at(step, cfg.batch_size))
        _, loss = self.model(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mean_loss, disagree = loss.item(), False
        if self.spec.groups > 1:
            mean_loss, disagree = self._average_across_groups(mean_loss, s.round)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = inner_lr(step, self.total_rounds * cfg.steps_per_round, cfg)
        participants = self.replicas.participants()
        if not self.replicas.commit():
            log.warning("group %d: step %d of round %d did not commit; redoing it", self.spec.group, s.pos, s.round)
            if disagree:
                self._resync(LOST)
            return
        self.optimizer.step()
        s.pos += 1
        s.tokens += participants * self.world.world_size * cfg.batch_size * self.cfg.data.seq_len
        s.loss_sum += mean_loss

    @staticmethod
    def _mark(meter, phase: str) -> None:
        if isinstance(meter, PeakRss):
            meter.mark(phase)

    def _average_across_groups(self, loss: float, round_: int) -> tuple[float, bool]:
        """Averages the local gradient shards (and the loss) across the groups in one all-reduce.

        The round rides along: if the groups disagree on it, then in every group
        mean(r) != r or mean(r^2) != r^2, and nobody commits.
        """
        grads = list(local_grads(self.model))
        r = float(round_ % 1024)
        extra = torch.tensor([loss, r, r * r], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat(grads + [extra])
        self.replicas.allreduce_(flat)
        mean_loss, mean_r, mean_r2 = flat[-3:].tolist()
        disagree = mean_r != r or mean_r2 != r * r
        if disagree:
            self.replicas.report_error(RuntimeError("replica groups are in different rounds"))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()])
            offset += g.numel()
        return mean_loss, disagree

    def _exchange(self) -> None:
        s = self.state
        meter = PeakRss() if self.spec.measure_memory else nullcontext()
        started = time.monotonic()
        with meter:
            pusher = self.replicas.participating_rank() == 0
            (loss_sum,) = self._group_reduce([s.loss_sum])
            train_loss = loss_sum / self.world.world_size / max(1, s.pos)
            if self.feedback is not None:
                # Every group moves its residual the same way, pushing or not (and before a push
                # that may be refused as a duplicate without encoding anything).
                for _ in self._chunks():
                    pass
            status = self._push(train_loss) if pusher else NOBODY
            self._mark(meter, "push")
            (status,) = self._group_reduce([status], dist.ReduceOp.MAX)
            flag = torch.tensor([status if pusher else 0.0], dtype=torch.float32, device=self.world.device)
            self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
            if not self.replicas.commit():
                log.warning("%s group %d: exchange of round %d did not commit (a group failed); redoing it", s.island_id, self.spec.group, s.round)
                return
            outcome = int(flag.item())
            if outcome == NOBODY:
                return
            trained = s.round
            if outcome == PUSHED:
                if self.feedback is not None:
                    self.feedback.commit()
                self._mark(meter, "agree")
                self._pull()
                self._mark(meter, "pull")
            else:
                self._resync(outcome)
        self.state.rounds_done += 1
        self.losses.append(train_loss)
        if self.spec.measure_memory and meter.peak_bytes is not None:
            self.memory.append({"round": trained, "pusher": pusher, "peak_rss_bytes": meter.peak_bytes, "phases": meter.phases})
        self.evidence.event("exchange", round=trained, pusher=pusher, outcome=outcome, carried=self.carried)
        log.info(
            "%s group %d rank %d round %d: train loss %.4f, exchange %.2fs (%s)",
            s.island_id, self.spec.group, self.world.rank, trained, train_loss, time.monotonic() - started,
            "pushed" if pusher else "pulled",
        )

    def _finish(self, last_try: bool = False) -> bool | None:
        """Agree across the groups that every shard equals theta_global; the quorum's rank-0 group leaves.

        Returns whether the coordinator confirmed our checksum (for the other
        groups: whether every shard verified), None if this step did not commit.
        """
        mine = ranges_checksum((r.name, r.offset, self.local[r.name]) for r in self.layout.ranges)
        (bad,) = self._group_reduce([float(mine != self.state.ranges_checksum)])
        flag = torch.tensor([float(bad == 0), 1.0], dtype=torch.float32, device=self.world.device)
        self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
        if not self.replicas.commit() and not last_try:
            return None
        verified = flag[0].item() == flag[1].item()
        if self.replicas.participating_rank() == 0 and self.world.is_leader:
            return self.client.leave(self.state.island_id, self.state.checksum if verified else "shards-differ", self.state.round)
        return verified

    # --- the loop --------------------------------------------------------------------

    def run(self, max_rounds: int | None = None):
        from islands.trainer import IslandResult

        self._fetch()
        if max_rounds is not None:
            self.state.stop_round = min(self.state.stop_round, self.state.round + max_rounds)
        if self.spec.groups > 1:
            self.replicas = Replicas(
                self.spec.ft, self.spec.group, self.world.rank, self.world.world_size, self.world.device,
                f"{self.spec.key}.group{self.spec.group}", self.state_dict, self.load_state_dict,
            )
        self.evidence.event("up", round=self.state.round)
        matches, finishing = None, 0
        assemble_until = time.monotonic() + self.spec.ft.startup_wait_s
        try:
            while True:
                healed = self.replicas.start_step()
                self._record(healed)
                s = self.state
                if self.replicas.participants() < self.spec.groups and time.monotonic() < assemble_until and not healed:
                    # Starting together: wait (bounded) for every group, so that all of them train
                    # from the first step instead of the late ones healing in later.
                    self.replicas.commit()
                    time.sleep(0.1)
                    continue
                assemble_until = 0.0
                if self.checkpoint is not None:
                    self.checkpoint.maybe_save(self)  # at a round's first step, by the quorum's rank-0 group
                if s.finished or s.round >= s.stop_round:
                    finishing += 1
                    matches = self._finish(last_try=finishing >= 5)
                    if matches is not None:
                        break
                elif s.pos < self.cfg.inner.steps_per_round:
                    self._inner_step()
                else:
                    self._exchange()
        finally:
            self._write_evidence()
            self.replicas.shutdown()
        s = self.state
        return IslandResult(s.island_id, s.rounds_done, s.round, s.checksum, bool(matches), self.losses)

    # --- evidence for tests and debugging (only with a report dir) ---------------------------

    def _record(self, healed: bool) -> None:
        if not self.evidence.enabled:
            return
        s = self.state
        opt = [v.to_local() if hasattr(v, "to_local") else v for st in self.optimizer.state.values() for k, v in sorted(st.items()) if k != "step"]
        # An event, not just the summary: a SIGKILLed rank leaves its events behind.
        self.evidence.event(
            "step", step=self.replicas.step(), round=s.round, pos=s.pos, healed=healed,
            model=digest(self.local.values()), globals=digest(self.global_shard.values()), optimizer=digest(opt),
        )

    def _write_evidence(self) -> None:
        summary = {
            "group": self.spec.group, "rank": self.world.rank, "world_size": self.world.world_size,
            "state": dataclasses.asdict(self.state), "healed_steps": self.replicas.healed_steps, "takeovers": self.takeovers,
            "ranges": [dataclasses.astuple(r) for r in self.layout.ranges], "full_model_fp32_bytes": 4 * self.manifest.total_numel(),
            "shard_fp32_bytes": 4 * self.layout.numel(), "memory": self.memory, "losses": [x for x in self.losses if math.isfinite(x)],
        }
        tensors = {"model": {n: t.detach().cpu().clone() for n, t in self.local.items()}, "global": self.global_shard}
        self.evidence.write(summary, tensors)
