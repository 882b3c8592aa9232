"""One fragment's round sequence: pushes spooled, then at close folded, stepped and published.

Without streaming the whole model is one fragment: plain DiLoCo's round state
machine. With Streaming DiLoCo each fragment has its own accumulator, outer
optimizer, publication, round counter, deadline and driver thread, so a slow
fragment never holds another back. What fragments share reaches them through
FragmentContext, a narrow seam (the condition variable, the clock, membership);
a fragment never sees the coordinator's state.

OPEN: pushes are spooled until an island's contribution is whole; between its
close checks the driver folds the complete ones that come first in canonical
order (fold_ahead, coordinator/fold.py FoldAhead). close():
CLOSING once every live island (not on probation) contributed or was dropped, max_islands did,
or the deadline passed with min_islands. apply(): folds the contributions in
canonical island order (the aggregate does not depend on arrival order), takes
the outer step, publishes, opens the next round; FINISHED after the last.
The close keeps what was folded ahead only when its contributions start with
exactly those, so the result is the same whenever folding happened.

Late contributions (rounds.late_rounds = k > 0): a push up to k rounds after its
round closed (or a contribution still incomplete at the close) is kept in
`late` and folded at the next close after the on-time ones, in canonical
island order, with its weight discounted by rounds.late_discount per round of
staleness (coordinator/records.py Contribution.weight); later than k it is
refused (ROUND_CLOSED). One coordinator folds them all, so copies stay identical.
A round does not wait for an island whose last contribution came late (`behind`)
until it contributes on time again.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from coordinator.fold import FoldAhead, fold, judge
from coordinator.intake import PushIntake
from coordinator.ledger import DataLedger
from coordinator.links import LinkAdvisor
from coordinator.locks import ReadWriteLock
from coordinator.membership import Membership, canonical_order
from coordinator.publish import DeltaStream, Publication, Reading, step_and_publish
from coordinator.records import (Closing, Contribution, Phase, Reason, Refused, close_reason, fold_key, round_summary,
                                 traffic_into)
from coordinator.spool import Spools
from diloco.codec import Codec
from diloco.config import RunConfig
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.robust import NormGuard, Sketcher
from diloco.v1 import diloco_pb2 as pb
from diloco.params import ranges_checksum
from diloco.wire import FlatRange, Manifest, downlink_codec, tensor_chunks

log = logging.getLogger(__name__)


@dataclass
class FragmentContext:
    """What a fragment's round machine shares with the rest of the coordinator."""

    cfg: RunConfig
    codec: Codec
    cond: threading.Condition
    clock: Callable[[], float]
    spools: Spools
    members: Membership
    run_finished: Callable[[], bool] = lambda: False  # every fragment finished (read holding cond)
    fragment_of: Callable[[str], int | None] = lambda name: None  # for messages about another fragment's parameter
    ledger: DataLedger | None = None  # token corpus: who trains on which samples
    codecs: dict[str, Codec] | None = None  # what islands may push with, by name (wire.link_codecs; None: the run's codec)
    links: LinkAdvisor | None = None  # compression per link: throughput measured, codecs advised (coordinator/links.py)
    pool: Executor | None = None  # threads a close's folds and lossy publications run on (None: the driver's)


class FragmentRounds(PushIntake):
    def __init__(self, ctx: FragmentContext, index: int, params: dict[str, torch.Tensor]):
        cfg = ctx.cfg
        self.ctx, self.cfg, self.index = ctx, cfg, index
        self.codec, self.cond, self.clock, self.members = ctx.codec, ctx.cond, ctx.clock, ctx.members
        # Messages name the fragment only when there is more than one.
        self.label = f"fragment {index} " if cfg.streaming.fragments > 1 else ""
        self.manifest = Manifest.of(params)
        self.outer = OuterOptimizer(params, cfg.outer)
        self.publication = Publication(params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes, ctx.pool)
        self.accumulator = PseudoGradientAccumulator(self.manifest.shapes)
        self.ahead = FoldAhead()  # what of the open round is folded already (the driver's thread only)
        self.guard = NormGuard(cfg.robust)
        self.sketcher = Sketcher(os.urandom(16))  # keys only this process knows (diloco/robust.py)
        self.param_lock = ReadWriteLock()
        self.phase, self.round, self.round_opened_at = Phase.OPEN, 0, self.clock()
        self.contributions: dict[str, Contribution] = {}
        # Late contributions (rounds.late_rounds) to fold at this round's close, by (island, round trained for), and
        # the checksum each recent round started from (what a late push must have trained from).
        self.late: dict[tuple[str, int], Contribution] = {}
        # Islands whose last contribution came late: a round does not wait for them (they are folded late again if
        # they miss it), so the islands that keep pace never idle for one that does not.
        self.behind: set[str] = set()
        self.published: dict[int, str] = {self.round: self.checksum}
        self.dropped: set[str] = set()
        self.traffic: dict[tuple[int, str], list[int]] = {}  # (round, island) -> [up, down]
        # The last closed round: islands and tokens in it, and (eager updates) its mean pseudo-gradient.
        self.last_islands = self.last_tokens = 0
        self.last_round_s = 0.0  # open to close (compression per link sizes pushes to it)
        self.mean_chunks: list[pb.TensorChunk] = []
        self.streaming: DeltaStream | None = None  # the next round's lossy update while it is made (apply)
        # Set by a restore: where the fragment restarted, and the latest round islands had reached.
        self.restored_round: int | None = None
        self.restored_at = self._last_wait_log = 0.0
        self.max_round_seen = 0

    @property
    def checksum(self) -> str:
        return self.publication.checksum

    def state_proto(self) -> pb.FragmentState:
        return pb.FragmentState(index=self.index, round=self.round, checksum=self.checksum)

    # --- reading the parameters ---------------------------------------------------

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float, ranges: list[FlatRange] | None = None,
                        interrupted: Callable[[], bool] = lambda: False) -> float:
        """Blocks until round_ has closed; returns the seconds it waited. Refuses at once if the island's push of
        these ranges (all of the fragment, when None) is not here: after a restart every rank pushes its own again.
        Returns early once interrupted() holds, looked at whenever cond is notified (the caller was revoked)."""
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, round_)
            if round_ > self.round:
                raise Refused(
                    Reason.ROUND_AHEAD,
                    f"{self.label}round {round_} is ahead of the coordinator's round {self.round} "
                    "(it restarted from a checkpoint); resync", current_round=self.round,
                )
            mine = self.contributions.get(island_id)
            if self.round == round_ and self.phase is Phase.OPEN and (mine is None or not mine.coverage.covers(ranges)):
                raise Refused(
                    Reason.PUSH_AGAIN,
                    f"no contribution from {island_id} in {self.label}round {round_} (the coordinator may have restarted); push again",
                    current_round=self.round,
                )
            started = self.clock()
            if not self.cond.wait_for(lambda: interrupted() or self.round > round_ or self.phase is Phase.FINISHED or (
                    self.streaming is not None and self.streaming.round > round_), timeout_s):
                raise Refused(Reason.STILL_OPEN, f"{self.label}round {round_} still open after {timeout_s:.0f}s", current_round=self.round)
            return self.clock() - started

    @contextmanager
    def reading(
        self, delta_from_round: int | None = None, want_mean: bool = False, ranges: list[FlatRange] | None = None,
        cancel: Callable[[], None] = lambda: None,
    ) -> Iterator[Reading]:
        """What a result of the fragment sends (publish.py Reading): its header; the delta chunks when the caller can
        take a delta, else the value messages; the last round's mean pseudo-gradient chunks when asked (eager
        updates); and, when the header's checksum is empty, the DeltaStream whose trailer completes it. With
        ranges, the header carries their checksum.

        Taken under the parameters' read lock, held only while it is taken: the caller sends it without the lock,
        at its client's pace, and the outer step never waits for that (the values are an immutable version,
        publish.py PublishedValues; cancel ends the caller's call should that version be dropped while it still
        reads it). A delta asked for while the next round's update is being made (apply) streams as it is made:
        the header then has no checksum and the caller sends the stream's trailer after the chunks (with ranges,
        their checksum: ranges_checksum_after).
        """
        reading = None
        with self.cond:
            stream = self.streaming
            if stream is not None and delta_from_round == stream.round - 1:
                reading = Reading(pb.ResultHeader(
                    round=stream.round, islands=stream.islands, tokens=stream.tokens, mode=pb.ResultHeader.DELTA,
                    codec=self.publication.codec.name, base_checksum=stream.base_checksum, fragment=self.index,
                ), delta=stream, mean=self.mean_chunks if want_mean else [], stream=stream)
        if reading is None:
            with self.param_lock.read():
                with self.cond:
                    reading = Reading(pb.ResultHeader(
                        round=self.round, checksum=self.checksum, run_finished=self.ctx.run_finished(),
                        islands=self.last_islands, mode=pb.ResultHeader.VALUES, codec="fp32", fragment=self.index,
                        tokens=self.last_tokens,
                    ))
                    pub, header = self.publication, reading.header
                    if delta_from_round is not None and delta_from_round == self.round - 1 and pub.delta_base:
                        header.mode, header.codec, header.base_checksum = pb.ResultHeader.DELTA, pub.codec.name, pub.delta_base
                        reading.delta = pub.delta_chunks  # a new list each round: never changed once published
                    reading.mean = self.mean_chunks if want_mean and delta_from_round == self.round - 1 else []
                if ranges is not None:
                    header.ranges_checksum = ranges_checksum(
                        (r.name, r.offset, pub.params[r.name].view(-1)[r.offset : r.end]) for r in ranges)
                if reading.delta is None:
                    reading.add_values(pub, cancel)
        try:
            yield reading
        finally:
            reading.done()

    def ranges_checksum_after(self, stream: DeltaStream, ranges: list[FlatRange]) -> str:
        """The ranges' checksum of the parameters a streamed update led to, once it was made (under the read lock,
        held only for the checksum: the caller sends it after)."""
        with self.param_lock.read():
            if self.round != stream.round:  # the run went on meanwhile (this island was dropped from a round)
                raise Refused(Reason.STILL_OPEN, f"{self.label}round {stream.round} is over; pull again", current_round=self.round)
            params = self.publication.params
            return ranges_checksum((r.name, r.offset, params[r.name].view(-1)[r.offset : r.end]) for r in ranges)

    # --- closing a round: close, then apply ------------------------------------------------

    def close_reason(self) -> str | None:
        """Why the current round may close now, or None. Caller holds cond."""
        behind = (self.behind | {i for i, _ in self.late}) - set(self.contributions)  # pushing on time now: waited for
        live = [i for i in self.members.waited_for() if i not in behind]
        overdue = self.clock() - self.round_opened_at > self.cfg.rounds.deadline_s
        done = [i for i, c in self.contributions.items() if c.state == "complete"]
        quorum = min(self.guard.quorum(), self.cfg.rounds.max_islands)  # the first outer step's (diloco/robust.py)
        least = max(self.cfg.rounds.min_islands, quorum)
        reason = close_reason(done, live, self.dropped, overdue, least, self.cfg.rounds.max_islands)
        if reason is None and done and self.clock() - self._last_wait_log > 10:
            if len(done) < quorum and self.cfg.rounds.min_islands < quorum:
                self._last_wait_log = self.clock()
                log.warning("%sround %d has %d contribution(s); the run's first outer step waits for robust.first_quorum=%d "
                            "(a lone first push has nothing to be judged against; a one-island run sets "
                            "robust.first_quorum=1)", self.label, self.round, len(done), quorum)
            elif overdue:
                self._last_wait_log = self.clock()
                log.warning("%sround %d is past its %gs deadline with %d of min_islands=%d contributions; still waiting",
                            self.label, self.round, self.cfg.rounds.deadline_s, len(done), least)
        return reason

    def close(self, poll_s: float = 0.2) -> Closing | None:
        """Waits up to poll_s for the close condition; when it holds, stops taking pushes and returns what to fold."""
        with self.cond:
            if self.phase is not Phase.OPEN:
                return None
            reason = self.close_reason()
            if reason is None:
                self.cond.wait(poll_s)
                reason = self.close_reason()
                if reason is None:
                    return None
            self.phase = Phase.CLOSING
            k = self.cfg.rounds.late_rounds
            for island_id in [i for i, c in self.contributions.items() if c.state == "pending"]:
                if k:  # its other streams may still come: it is folded late, into a later round
                    self.late[(island_id, self.round)] = self.contributions.pop(island_id)
                    continue
                log.warning("%sround %d: %s's contribution was incomplete; dropped", self.label, self.round, island_id)
                self.drop(island_id)
            for key in [key for key, c in self.late.items() if c.state == "pending" and self.round + 1 - c.origin > k]:
                log.warning("%sround %d: %s's late contribution to round %d was incomplete; dropped", self.label, self.round, *key)
                for spool in self.late.pop(key).spools:
                    spool.discard()
            complete = [(i, self.contributions[i]) for i in canonical_order(self.contributions)]
            # Late ones after the on-time ones, in canonical island order, then by the round they trained for.
            rank = {i: n for n, i in enumerate(canonical_order({i for i, _ in self.late}))}
            for key in sorted((key for key, c in self.late.items() if c.state == "complete"), key=lambda key: (rank[key[0]], key[1])):
                late = self.late.pop(key)
                late.staleness = self.round - late.origin
                late.discount = self.cfg.rounds.late_discount ** late.staleness
                complete.append((key[0], late))
            late_now = {i for i, c in complete if c.staleness} | {i for i, _ in self.late}
            self.behind = (self.behind | late_now) - set(self.contributions)
            self.contributions.clear()
            return Closing(reason, complete, self.clock() - self.round_opened_at)

    def fold_ahead(self) -> bool:
        """While the round is open: folds the next contribution in canonical order if it is complete (coordinator/fold.py
        FoldAhead); returns whether it folded one. Called by the round's driver between its close checks, so the
        accumulator is never folded ahead and closed at once."""
        with self.cond:
            if self.phase is not Phase.OPEN:
                return False
            nxt = self.ahead.next(self.contributions, self.members.waited_for())
        if nxt is None:
            return False
        self.ahead.fold(self.accumulator, self.codec, *nxt, self.manifest.total_numel(), self.ctx.pool)
        return True

    def apply(self, closing: Closing) -> pb.RoundSummary:
        """Folds, takes the outer step, publishes the result and opens the next round; returns the round's summary."""
        verdict = judge(self.guard, closing.contributions, self.label)
        kept = [(i, c) for i, c in closing.contributions if fold_key(i, c) not in verdict.dropped]
        summary = round_summary(self.round, self.index, kept, self.manifest.total_numel(), self.cfg)
        summary.clipped.extend(verdict.clipped)
        self.dropped.update(verdict.dropped)
        self.publication.release_values()
        summary.wait_s, started = closing.waited_s, time.perf_counter()
        delayed = self.cfg.rounds.late_mode == "delayed_nesterov"  # late ones apart (diloco/outer.py)
        ahead = self.ahead.take(self.accumulator, closing.contributions, verdict)  # folded while the round was open
        for _, contribution in closing.contributions[:ahead]:
            for spool in contribution.spools:
                spool.discard()
        folded = fold(self.accumulator, self.codec, closing.contributions[ahead:], verdict, self.manifest.total_numel(), delayed,
                      self.ctx.pool)
        folded += ahead * self.manifest.total_numel()
        summary.fold_s, summary.folded_ahead = time.perf_counter() - started, ahead
        # A round that folds no weight (every contribution trained on 0 tokens, or dropped) takes no outer step: a step
        # on momentum alone would move the parameters with no data behind it. The parameters, momentum and checksum
        # stay; the round moves on.
        skipped = not any(c.weight for _, c in kept)
        if skipped:
            log.warning("%sround %d folds no tokens (%d contribution(s), none with weight): no outer step", self.label,
                        self.round, len(closing.contributions))
        # Step, publication and round change happen under the write lock, so no
        # reader ever sees new parameters under an old round number or the reverse.
        self.param_lock.acquire_write()
        try:
            started = time.perf_counter()
            # Streamed (a lossy downlink, Nesterov): each chunk's span is divided into the mean, stepped and published
            # in one go, on every core, while pulls send the chunks made so far. Else the whole step, then publication.
            streamed = not skipped and not delayed and not self.publication.lossless and self.outer.steps_by_parameter
            eager_s = 0.0  # counted with the publication, as it is sent with it
            if self.cfg.streaming.eager and not skipped:
                # Eager updates: islands build their provisional update from this (downlink codec, no feedback).
                # Encoded before the step, which may overwrite the mean (the accumulator is reset after it).
                eager_s = time.perf_counter()
                self.mean_chunks = list(tensor_chunks(self.accumulator.mean(), self.publication.codec, self.cfg.wire.chunk_bytes))
                eager_s = time.perf_counter() - eager_s
            stream = None
            if skipped:
                self.mean_chunks = []
                self.publication.unchanged()
            elif streamed:
                stream = DeltaStream(self.round + 1, self.checksum, len({i for i, _ in closing.contributions}), summary.tokens)
                with self.cond:
                    self.streaming = stream
                    self.cond.notify_all()
                try:
                    summary.step_s, summary.publish_s = step_and_publish(self.publication, self.accumulator, self.outer, stream)
                except BaseException:
                    stream.fail()
                    with self.cond:
                        self.streaming = None
                    raise
                summary.publish_s += eager_s
            else:
                mean, late = self.accumulator.parts()
                if delayed:
                    self.outer.step_delayed(mean, late)
                else:
                    self.outer.step(mean, consume=True)
                summary.step_s, started = time.perf_counter() - started - eager_s, time.perf_counter() - eager_s
                self.publication.publish()
                summary.publish_s = time.perf_counter() - started
            summary.closed_at = time.time()
            with self.cond:
                self.traffic = traffic_into(summary, self.traffic, self.round)
                summary.checksum = self.checksum
                summary.seconds = self.clock() - self.round_opened_at
                summary.dropped.extend(sorted(self.dropped))
                summary.elements_folded = folded
                summary.elements_expected = self.manifest.total_numel() * len(kept)
                if self.ctx.ledger is not None:
                    summary.data.CopyFrom(self.ctx.ledger.settle(self.index, [c.samples for _, c in kept], self.members.live()))
                self._count_restart_cost()
                self.members.after_round(self.round_opened_at, [i for i, _ in closing.contributions])
                self.members.events.late_folded += sum(1 for i, c in kept if c.staleness)
                self.last_islands = len({i for i, _ in closing.contributions})  # an island may be in it on time and late
                self.last_tokens, self.last_round_s = summary.tokens, summary.seconds
                self.accumulator.reset()
                self.dropped.clear()
                self.round += 1
                self.round_opened_at = self.clock()
                self.published = {r: c for r, c in self.published.items() if r >= self.round - self.cfg.rounds.late_rounds}
                self.published[self.round] = self.checksum
                self.phase = Phase.FINISHED if self.round >= self.cfg.rounds.rounds else Phase.OPEN
                # Decided with the phase change, so exactly one fragment's summary finishes the run.
                summary.run_finished = self.ctx.run_finished()
                if stream is not None:
                    self.streaming = None
                    stream.finish(self.checksum, summary.run_finished)
                self.cond.notify_all()
        finally:
            self.param_lock.release_write()
        log.info("%sround %d closed (%s) with %d islands", self.label, summary.round, closing.reason, len(closing.contributions))
        return summary

    def _count_restart_cost(self) -> None:
        """The first round closed since a restart: count what the restart cost. Caller holds cond."""
        if self.restored_round is not None:
            events = self.members.events
            events.rounds_lost += max(0, self.max_round_seen - self.restored_round)
            events.recovery_s += self.clock() - self.restored_at
            self.restored_round = None

    # --- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The fragment's round and outer state (its parameters are saved by the caller, whole-model)."""
        return {
            # Copied: another fragment's driver may step while the checkpoint is written.
            "round": self.round, "last": [self.last_islands, self.last_tokens], "outer": copy.deepcopy(self.outer.state_dict()),
            "published": self.publication.state_dict(), "guard": self.guard.state_dict(),
        }

    def load_state_dict(self, state: dict, finished: bool) -> None:
        """Restores a checkpoint's round (its outer parameters already copied in); the round reopens now."""
        self.outer.load_state_dict(state["outer"], delayed=self.cfg.rounds.late_mode == "delayed_nesterov")
        self.accumulator.reset()
        self.ahead.reset()
        self.publication.load_state_dict(state["published"])
        self.guard.load_state_dict(state.get("guard", {}))
        with self.cond:
            now = self.clock()
            self.round = state["round"]
            self.phase = Phase.FINISHED if finished or self.round >= self.cfg.rounds.rounds else Phase.OPEN
            self.round_opened_at = self.restored_at = now
            # What earlier rounds started from is not in the checkpoint: a push for them is refused (ROUND_CLOSED).
            self.published = {self.round: self.checksum}
            self.restored_round = self.round
            self.last_islands, self.last_tokens = state["last"]
