"""The island and the coordinator's results: start, landing, resync, finish, and what a healing group gets.

Part of islands/island.py's Island (a mixin, to keep each file short): every
method here runs on every rank of every replica group at the same step, so the
agreements (within a group with torch.distributed, across the groups through
torchft) line up.

What a replica group that dies or heals while a fragment's exchange is in flight does:

- Only the group that was rank 0 of the quorum at the sync pushes; the others
  encode the same chunks (their error feedback moves alike) and, overlapped,
  pull in the background, waiting for the pusher's copy to arrive.
- At the landing the groups agree on the push outcome in a torchft step. If
  the pushing group died before reporting, nobody reports a push: the
  quorum's new rank-0 group pushes from its own snapshot of the
  pseudo-gradient (bit-identical across groups); what its predecessor
  delivered is refused as a duplicate, which counts as delivered, so the
  round gets the island's contribution exactly once, and the waiting pulls
  complete. The landing is then agreed again at the next step.
- A group that heals meanwhile receives, with the model shard, optimizer
  state and theta_global (never half-written: overlapped pulls write into a
  staging copy), the exchanges in flight and their pseudo-gradient
  snapshots; it pulls at the landing, and can take a push over like any group.
- Fragments always sync and land in index order at the same steps in every
  group, so no two groups ever wait on different fragments' collectives.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import grpc
import torch
import torch.distributed as dist

from diloco.inner import build_inner_optimizer
from diloco.streaming import mix_, swap_estimate_
from diloco.v1 import diloco_pb2 as pb
from islands import exchange
from islands.evidence import digest, fault_due, maybe_fault
from islands.exchange import LOST, NOBODY, PUSHED, REJOIN, RELEASE, RESET, Exchange
from islands.outcome import Next, next_step

log = logging.getLogger(__name__)

_PULL_TROUBLE = {Next.RESYNC: LOST, Next.PUSH_AGAIN: LOST, Next.FINISHED: LOST, Next.WAIT: LOST, Next.REJOIN: REJOIN,
                 Next.RESET: RESET, Next.RELEASE: RELEASE}


class Landing:
    # --- start: fetch theta_global; a resumed island keeps the fragments it has right ----------------

    @torch.no_grad()
    def start(self) -> None:
        s = self.state
        into = self.global_shard if not self.restored else {n: torch.empty_like(t) for n, t in self.global_shard.items()}
        header = self._fetch_all(into)
        rounds = [f.round for f in header.fragments] or [header.round]
        sums = [f.checksum for f in header.fragments] or [header.checksum]
        adopt = [not self.restored or (r, c) != (mine, own) for r, c, mine, own in zip(rounds, sums, s.rounds, s.checksums)]
        if self.restored and any(adopt):
            log.warning("%s: checkpoint is at fragment rounds %s, the coordinator at %s; resyncing %s",
                        s.island_id, s.rounds, rounds, [f for f, a in enumerate(adopt) if a])
        for f in (f for f, a in enumerate(adopt) if a):
            for name, t in self.fragments[f].global_.items():
                if self.restored:
                    t.copy_(into[name])
            s.rounds[f], s.checksums[f] = rounds[f], sums[f]
        if any(adopt):
            s.step = self.layout.start_step(s.rounds, self.total_rounds)
            for f in range(len(self.fragments)):
                s.restart_fragment(f)
        for f in (f for f, a in enumerate(adopt) if a):
            mix_(self.fragments[f].local, self.fragments[f].flat, 0.0)  # theta_local <- theta_global
        s.finished = s.finished or header.run_finished

    def _fetch_all(self, into: dict[str, torch.Tensor]) -> pb.ResultHeader:
        """Every fragment's global parameters (this rank's ranges), the same round on every rank of the group."""
        for _ in range(5):
            header = self.client.fetch(self.state.island_id, into, self.manifest, None if self.whole else self.shard.ranges)
            lo, hi = self.group_reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                return header
            log.warning("ranks fetched different rounds (%d..%d); fetching again", -lo, hi)
        raise RuntimeError("the group's ranks could not fetch the same round of global parameters; is the coordinator restarting?")

    @torch.no_grad()
    def _rewind(self) -> None:
        """The coordinator is behind this island (it restarted from a checkpoint of an earlier round): every fragment
        goes back to the coordinator's round and the island trains from that round's start, as a resumed island does
        (start()), so each round it replays holds all of its inner steps. Only the work since the coordinator's
        checkpoint is lost. With fragments, a per-fragment shift would not do: the fragments share one step counter."""
        s = self.state
        header = self._fetch_all(self.global_shard)
        s.rounds = [f.round for f in header.fragments] or [header.round]
        s.checksums = [f.checksum for f in header.fragments] or [header.checksum]
        s.finished = s.finished or header.run_finished
        s.step = self.layout.start_step(s.rounds, self.total_rounds)
        for f, shard in enumerate(self.fragments):
            s.restart_fragment(f)
            mix_(shard.local, shard.flat, 0.0)
            if self.eager is not None:
                self.eager[f].forget()
        log.warning("%s: the coordinator went back to fragment rounds %s (it restarted): training again from inner step %d",
                    s.island_id, s.rounds, s.step)

    # --- landing: agree on the push, pull, mix the result in ------------------------------------------

    @torch.no_grad()
    def land(self, f: int) -> bool:
        """Lands fragment f's exchange; False when this step did not settle it (redo at the next step)."""
        ex, shard, s = self.inflight[f], self.fragments[f], self.state
        waited = time.monotonic()
        if ex.pusher:  # tests: the pushing group dying with the exchange in flight
            maybe_fault("die-before-land", self.spec.group, self.world.rank, ex.round, f)
        ex.pushed.wait()
        (status,) = self.group_reduce([ex.status if ex.pusher and ex.status is not None else NOBODY], dist.ReduceOp.MAX)
        flag = torch.tensor([status], dtype=torch.float32, device=self.world.device)
        self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
        if not self.replicas.commit():
            log.warning("%s group %d: landing of fragment %d round %d did not commit; redoing it", s.island_id, self.spec.group, f, ex.round)
            return False
        outcome = int(flag.item())
        if outcome == NOBODY:
            # The pushing group is gone: the quorum's rank-0 group pushes from its own copy.
            if self.replicas.participating_rank() == 0:
                log.info("group %d rank %d: taking over the push of fragment %d round %d", self.spec.group, self.world.rank, f, ex.round)
                ex.pusher, self.takeovers = True, self.takeovers + 1
                self.evidence.event("takeover", round=ex.round, fragment=f)
                ex.status = exchange.push(shard, ex, self.wire)
            return False
        trouble = outcome if outcome != PUSHED else 0
        if outcome == PUSHED:
            if self.feedback is not None:
                self.feedback.commit(list(shard.global_))
            if fault_due("perturb-before-pull", self.spec.group, self.world.rank, ex.round):
                next(t for t in (ex.staging or shard.global_).values() if t.numel()).view(-1)[0] += 0.5
            if ex.thread is None and not isinstance(ex.outcome, (pb.ResultHeader, BaseException)):
                self._pull_now(shard, ex)  # blocking exchanges, and a group that healed meanwhile
            exchange.wait(ex)
            if isinstance(ex.outcome, grpc.RpcError):
                log.warning("%s rank %d: pull of fragment %d round %d failed: %s", s.island_id, self.world.rank, f, ex.round, ex.outcome)
                trouble = _PULL_TROUBLE.get(next_step(ex.outcome))
                if trouble is None:
                    raise ex.outcome
            elif isinstance(ex.outcome, BaseException):
                raise ex.outcome
        else:
            ex.cancel.set()
            exchange.wait(ex)
        got = ex.outcome.round if isinstance(ex.outcome, pb.ResultHeader) else -1
        trouble, lo, hi = self.group_reduce([trouble, -got, got], dist.ReduceOp.MAX)
        del self.inflight[f]
        carried = 0.0  # sum |residual| kept in the local shard (wire.feedback_in_model)
        if trouble or -lo != hi:
            self.resync(f, int(trouble) or LOST)
        else:
            if ex.folded_into >= 0:  # the push was late: the coordinator folds it into a later round, discounted
                self.late_folds += 1
                log.info("%s: fragment %d round %d was folded late, into round %d; training for round %d", s.island_id, f,
                         ex.round, ex.folded_into, got)
            carried = self._adopt(f, ex)
        ex.landed_at = time.monotonic()
        blocked = ex.landed_at - (ex.started_at if not ex.background else waited)
        self.timing["wait_s"] += blocked
        self.timing["straggler_s"] += min(blocked, ex.held_s)
        self.exchanges.append(ex.record())
        if f == 0:
            s.rounds_done += 1
        self.evidence.event("exchange", round=ex.round, fragment=f, pusher=ex.pusher, outcome=outcome, carried=carried,
                            due=ex.due, pushed_step=ex.pushed_step, globals=digest(self.fragments[f].flat.values()) if self.evidence.enabled else "")
        return True

    def _pull_now(self, shard, ex: Exchange) -> None:
        try:
            ex.outcome = exchange.pull(shard, ex, self.wire)
        except grpc.RpcError as e:
            ex.outcome = e
        ex.finished_at = time.monotonic()

    def _adopt(self, f: int, ex: Exchange) -> float:
        """The round's result landed: mix it into theta_local (pure adoption when the island stops here).
        Returns the residual kept in the local shard (sum of magnitudes; 0 unless wire.feedback_in_model)."""
        s, shard, header = self.state, self.fragments[f], ex.outcome
        if ex.staging is not None:
            for name, t in shard.global_.items():
                t.copy_(ex.staging[name])
        s.rounds[f], s.checksums[f] = header.round, header.checksum
        s.finished = s.finished or header.run_finished
        self._align_step(f)  # a late fold may land us more than one round on
        if header.push_codec in self.wire.codecs and header.push_codec != (s.codecs[f] or self.wire.codec.name):
            # Compression per link: every rank and group hears the same advice; error feedback carries over as is.
            log.info("%s: fragment %d pushes with %s from round %d (was %s)", s.island_id, f, header.push_codec, header.round,
                     s.codecs[f] or self.wire.codec.name)
            s.codecs[f] = header.push_codec
        final = header.round >= s.stop_round or header.run_finished  # the island ends holding exactly theta_global
        eager = self.eager[f] if self.eager is not None else None
        carried = 0.0
        if final:
            mix_(shard.local, shard.flat, 0.0)
        elif ex.estimate is not None:
            swap_estimate_(shard.local, shard.flat, ex.estimate, self.alpha)
        else:
            mix_(shard.local, shard.flat, self.alpha)
            if self.feedback is not None and self.feedback.in_model:
                # What the codec did not send stays in this island's parameters.
                self.feedback.keep_residual_(shard.local, 1.0 - self.alpha)
                carried = sum(self.feedback.buffers[n].abs().sum().item() for n in shard.local)
        if eager is not None:
            if ex.mean is not None and ex.mean.complete and header.tokens > 0 and header.round == ex.round + 1:
                eager.replica.advance(ex.mean.tensors)
                eager.prev_mean, eager.prev_own, eager.share = ex.mean.tensors, ex.pg, min(1.0, ex.tokens / header.tokens)
            else:
                eager.forget()
        return carried

    # --- resync: the round went on without us, or our copy drifted ------------------------------------

    @torch.no_grad()
    def resync(self, f: int, why: int) -> None:
        s, shard = self.state, self.fragments[f]
        log.warning("%s group %d: fragment %d resyncs after round %d (outcome %d)", s.island_id, self.spec.group, f, s.rounds[f], why)
        if why == REJOIN:
            joined = (self.client.join(self.cfg.digest(), self.codec.name, s.island_id, self.spec.key,
                                       ranks=self.spec.groups * self.world.world_size) if self.world.is_leader else None)
            s.island_id = self.world.broadcast_object(joined.island_id if joined else None)
        if why == RESET:  # our training diverged: a fresh inner optimizer and error feedback
            self.optimizer = build_inner_optimizer(self.model, self.cfg.inner)
            if self.feedback is not None:
                self.feedback.reset()
        if why == RELEASE:
            log.warning("%s: the coordinator does not know our leases of samples; taking new ones", s.island_id)
            s.forget_leases()
        one = None if len(self.fragments) == 1 else f
        for _ in range(5):
            header = self.client.fetch(s.island_id, shard.global_, shard.manifest, shard.wire_ranges, fragment=one)
            lo, hi = self.group_reduce([-header.round, header.round], dist.ReduceOp.MAX)
            if -lo == hi:
                break
        s.resyncs += 1
        if one is not None and header.round < s.rounds[f]:
            self._rewind()  # the coordinator restarted behind us (fragments share the step counter)
            return
        s.rounds[f], s.checksums[f] = header.round, header.checksum
        s.finished = s.finished or header.run_finished
        mix_(shard.local, shard.flat, 0.0)
        self._align_step(f)  # the coordinator may be more than one round on
        s.restart_fragment(f)
        if self.eager is not None:
            self.eager[f].forget()

    # --- finish: every rank holds theta_global; the quorum's rank-0 group leaves ------------------------

    def finish(self, last_try: bool = False) -> bool | None:
        """Agrees across the groups that every shard equals theta_global, then leaves.

        Returns whether the coordinator confirmed our parameters (for the other
        groups: whether every shard matched), None if this step did not commit.
        """
        s = self.state
        # Leaving early, or time-boxed fragments (each ends its last round at its own step; the steps after it moved the
        # model's copy of that fragment): end on the global parameters all the same.
        if s.stop_round < self.total_rounds and not s.finished or self.pace.time_boxed and len(self.fragments) > 1:
            for shard in self.fragments:
                mix_(shard.local, shard.flat, 0.0)
        mine = all(torch.equal(self.local[n].cpu(), t.view(-1)) for n, t in self.global_shard.items())
        (bad,) = self.group_reduce([float(not mine)])
        flag = torch.tensor([float(bad == 0), 1.0], dtype=torch.float32, device=self.world.device)
        self.replicas.allreduce_(flag, dist.ReduceOp.SUM)
        if not self.replicas.commit() and not last_try:
            return None
        verified = flag[0].item() == flag[1].item()
        self.final_checksum = ""
        if self.replicas.participating_rank() == 0 and self.world.is_leader:
            stats = {k: v for k, v in self.timing.items() if k in pb.LeaveRequest.DESCRIPTOR.fields_by_name}
            reply = self.client.leave(s.island_id, "", s.round, dict(stats, inner_steps=s.step),
                                      fragment_checksums=list(s.checksums) if verified else ["shards-differ"],
                                      untrained=s.untrained() if self.feed.leased else [])
            self.final_checksum = reply.checksum if reply.checksum_matches else "differs"
            return reply.checksum_matches
        return verified

    # --- healing: what a restarted group receives from a live peer -----------------------------------

    def heal_state_dict(self) -> dict:
        from islands.fsdp import optimizer_state_to_local

        return {
            "model": {n: t.detach() for n, t in self.local.items()},
            "optimizer": optimizer_state_to_local(self.optimizer),
            "global": self.global_shard,
            "feedback": self.feedback.state_dict() if self.feedback is not None else {},
            "eager": [e.state_dict() for e in self.eager] if self.eager is not None else [],
            "inflight": {f: ex.state_dict() for f, ex in self.inflight.items()},
            "position": self.state.state_dict(),
            "clock": {"agreed": list(self.agreed_clock), "pace": self.pace.state_dict()},  # time-boxed rounds
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
        step, agreed = sd["clock"]["agreed"]
        self.agreed_clock = (int(step), list(agreed))
        self.pace.load_state_dict(sd["clock"]["pace"])
        self.inflight = {int(f): Exchange(**saved, pusher=False, status=NOBODY) for f, saved in sd["inflight"].items()}
        for ex in self.inflight.values():
            ex.pushed.set()  # it pulls at the landing; the push is its peers' (or a takeover's)
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
            "state": dataclasses.asdict(self.state), "healed_steps": self.replicas.healed_steps, "takeovers": self.takeovers,
            "ranges": [dataclasses.astuple(r) for r in self.shard.ranges], "full_model_fp32_bytes": 4 * self.manifest.total_numel(),
            "shard_fp32_bytes": 4 * self.shard.numel(), "memory": self.memory, "losses": [x for x in self.losses if math.isfinite(x)],
        }
        tensors = {"model": {n: t.detach().cpu().clone() for n, t in self.local.items()},
                   "global": {n: t.view(-1) for n, t in self.global_shard.items()}}
        self.evidence.write(summary, tensors)
