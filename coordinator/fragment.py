"""One fragment's round sequence: pushes spooled then folded, the outer step, publication.

Without streaming the whole model is one fragment and this is the round state
machine of plain DiLoCo. With Streaming DiLoCo every fragment has its own:
accumulator, outer optimizer (momentum for its parameters), publication (the
downlink's error feedback), round counter, deadline and close condition, and
its own driver thread; so a fragment whose islands are slow never holds
another back. Membership (islands and their leases) is shared, in
CoordinatorState, and so is the condition variable every wait uses.

A round is OPEN while islands push; the driver moves it to CLOSING when its
close condition holds (every live island has contributed or was dropped,
max_islands have contributed, or the deadline passed with at least
min_islands), waits for folds in flight, applies the outer step, publishes the
result and opens the next round. After the last round the fragment is
FINISHED; the run is finished when every fragment is.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import grpc
import torch

from coordinator.locks import ReadWriteLock
from coordinator.publish import Publication
from coordinator.records import ACCEPTED_CHUNKS_KEY, Closed, Contribution, Phase, Refused
from coordinator.spool import Spool
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import ChunkCorrupt, ChunkError, Coverage, Manifest, decode_chunk, downlink_codec, tensor_chunks

__all__ = ["ACCEPTED_CHUNKS_KEY", "Closed", "FragmentRounds", "Phase", "Refused"]

if TYPE_CHECKING:
    from coordinator.state import CoordinatorState

log = logging.getLogger(__name__)

class FragmentRounds:
    def __init__(self, owner: "CoordinatorState", index: int, params: dict[str, torch.Tensor]):
        cfg = owner.cfg
        self.owner = owner
        self.index = index
        self.cfg = cfg
        self.codec = owner.codec
        self.cond = owner.cond
        self.clock = owner.clock
        # Messages name the fragment only when there is more than one.
        self.label = f"fragment {index} " if cfg.streaming.fragments > 1 else ""
        self.manifest = Manifest.of(params)
        self.outer = OuterOptimizer(params, cfg.outer)
        self.publication = Publication(params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes)
        self.accumulator = PseudoGradientAccumulator(self.manifest.shapes)
        self.param_lock = ReadWriteLock()
        self.fold_lock = threading.Lock()
        self.phase = Phase.OPEN
        self.round = 0
        self.round_opened_at = self.clock()
        self.contributions: dict[str, Contribution] = {}
        self.dropped: set[str] = set()
        self.elements_folded = 0
        self.traffic: dict[tuple[int, str], list[int]] = {}  # (round, island) -> [up, down]
        # The last closed round: islands and tokens in it, and (eager updates) its mean pseudo-gradient.
        self.last_islands = 0
        self.last_tokens = 0
        self.mean_chunks: list[pb.TensorChunk] = []
        # Set by a restore: where the fragment restarted, and the latest round islands had reached.
        self.restored_round: int | None = None
        self.restored_at = 0.0
        self.max_round_seen = 0
        self._last_wait_log = 0.0

    @property
    def checksum(self) -> str:
        return self.publication.checksum

    # --- pushes -----------------------------------------------------------------

    def begin_push(self, header: pb.PushHeader) -> None:
        """Checks a push's header before any chunk is read."""
        self.owner.touch(header.island_id)
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, header.round)
            if self.phase is Phase.FINISHED:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"the run has finished{' for ' + self.label.strip() if self.label else ''}")
            if header.round != self.round or self.phase is not Phase.OPEN:
                self.owner.events.late_pushes += 1
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.label}round {header.round} is closed (current round {self.round}); "
                    "fetch the global parameters and train for the current round",
                )
            if header.island_id in self.dropped:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{header.island_id} was dropped from {self.label}round {self.round}")
            if header.codec != self.codec.name:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"codec {header.codec!r} does not match the run's {self.codec.name!r}")
            if header.tokens <= 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tokens must be positive, got {header.tokens}")
            if header.global_checksum and header.global_checksum != self.checksum:
                self.owner.events.checksum_resyncs += 1
                log.warning(
                    "%s trained %sround %d from global parameters with checksum %s, not the coordinator's %s; "
                    "it must resync", header.island_id, self.label, self.round, header.global_checksum[:12], self.checksum[:12],
                )
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "your global parameters differ from the coordinator's (checksum mismatch); fetch them again",
                )
            existing = self.contributions.get(header.island_id)
            if existing is not None and existing.state != "pending":
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"{header.island_id} already contributed to {self.label}round {self.round}")
            if existing is not None and existing.tokens != header.tokens:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tokens {header.tokens} differ from {existing.tokens} sent earlier for this round",
                )

    def _decode(self, chunk: pb.TensorChunk) -> torch.Tensor:
        if chunk.name not in self.manifest.shapes and chunk.name in self.owner.manifest.shapes:
            raise ChunkError(
                f"{chunk.name} belongs to fragment {self.owner.layout.fragment_of(chunk.name)}, not to fragment {self.index}"
            )
        return decode_chunk(chunk, self.manifest, self.codec)

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        """Spools one push stream; folds the contribution into the aggregate once it is whole.

        A broken stream or a bad chunk discards this stream's spool, so the
        aggregate never sees part of a contribution. A corrupt chunk keeps the
        chunks before it and tells the island how many to skip when it resends.
        """
        self.begin_push(header)
        spool: Spool | None = Spool(self.owner.spool_dir)
        ranges: list[tuple[str, int, int]] = []
        try:
            for chunk in chunks:
                try:
                    values = self._decode(chunk)
                except ChunkCorrupt as e:
                    self._attach(header, spool, ranges)
                    spool = None  # the contribution owns the chunks kept so far
                    raise Refused(
                        grpc.StatusCode.DATA_LOSS, f"{e}; resend from chunk {len(ranges)}",
                        trailing=((ACCEPTED_CHUNKS_KEY, str(len(ranges))),),
                    ) from e
                except ChunkError as e:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
                if not torch.isfinite(values).all():
                    self._drop_nonfinite(header, chunk)
                spool.write(chunk)
                ranges.append((chunk.name, chunk.offset, chunk.numel))
                self._count(header.round, header.island_id, up=chunk.ByteSize())
            return self._attach(header, spool, ranges)
        except BaseException:
            if spool is not None:
                spool.discard()
            raise

    def _drop_nonfinite(self, header: pb.PushHeader, chunk: pb.TensorChunk) -> None:
        with self.cond:
            if header.island_id in self.contributions:
                self.drop(header.island_id)
            self.dropped.add(header.island_id)
            self.owner.events.dropped_nonfinite += 1
            self.cond.notify_all()
        log.error(
            "%s pushed a pseudo-gradient with NaN/Inf in %s (elements %d..%d); dropped from %sround %d",
            header.island_id, chunk.name, chunk.offset, chunk.offset + chunk.numel, self.label, header.round,
        )
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"pseudo-gradient is not finite in {chunk.name}; dropped from {self.label}round {header.round}: resync and go on",
        )

    def _attach(self, header: pb.PushHeader, spool: Spool, ranges: list[tuple[str, int, int]]) -> pb.PushResponse:
        spool.close()
        with self.cond:
            if header.round != self.round or self.phase is not Phase.OPEN:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{self.label}round {header.round} closed while the push was in flight")
            if header.island_id not in self.owner.islands or header.island_id in self.dropped:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{header.island_id} left {self.label}round {header.round} while pushing")
            contribution = self.contributions.get(header.island_id)
            if contribution is None:
                contribution = Contribution(header.tokens, header.train_loss, Coverage(self.manifest))
                self.contributions[header.island_id] = contribution
            trial = contribution.coverage.copy()
            for name, offset, numel in ranges:
                trial.add(name, offset, numel)
            problem = trial.problem()
            if problem and "more than once" in problem:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"push overlaps data already received: {problem}")
            contribution.coverage = trial
            contribution.spools.append(spool)
            if problem:  # more streams of this island's contribution are still to come
                return pb.PushResponse(accepted=True, elements=sum(r[2] for r in ranges))
            contribution.state = "folding"
        self._fold(contribution)
        with self.cond:
            contribution.state = "committed"
            log.info("%sround %d: %s contributed %d tokens", self.label, header.round, header.island_id, header.tokens)
            self.cond.notify_all()
        return pb.PushResponse(accepted=True, elements=sum(r[2] for r in ranges), contribution_complete=True)

    def _fold(self, contribution: Contribution) -> None:
        with self.fold_lock:
            scale = self.accumulator.scale_for(contribution.tokens)
            folded = 0
            for spool in contribution.spools:
                for chunk in spool.read():
                    values = decode_chunk(chunk, self.manifest, self.codec)
                    self.accumulator.add_chunk(chunk.name, chunk.offset, values, scale)
                    folded += chunk.numel
                spool.discard()
            # Coverage proved exactly-once already; this is the invariant the summary reports.
            assert folded == self.manifest.total_numel(), (folded, self.manifest.total_numel())
            self.accumulator.commit(contribution.tokens)
            self.elements_folded += folded

    def drop(self, island_id: str) -> None:
        """Forgets an island's contribution to this round. Caller holds cond."""
        contribution = self.contributions.pop(island_id)
        for spool in contribution.spools:
            spool.discard()

    def drop_pending(self, island_id: str) -> None:
        """An island left: its half-pushed contribution goes. Caller holds cond."""
        contribution = self.contributions.get(island_id)
        if contribution is not None and contribution.state == "pending":
            self.drop(island_id)

    def _count(self, round_: int, island_id: str, up: int = 0, down: int = 0) -> None:
        with self.cond:
            entry = self.traffic.setdefault((round_, island_id), [0, 0])
            entry[0] += up
            entry[1] += down

    def count_down(self, round_: int, island_id: str, n: int) -> None:
        self._count(round_, island_id, down=n)

    # --- reading the parameters ---------------------------------------------------

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float) -> float:
        """Blocks until round_ has closed; returns the seconds it waited. Refuses at once if the island's push is not here."""
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, round_)
            if round_ > self.round:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{self.label}round {round_} is ahead of the coordinator's round {self.round} "
                    "(it restarted from a checkpoint); resync",
                )
            if self.round == round_ and self.phase is Phase.OPEN and island_id not in self.contributions:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no contribution from {island_id} in {self.label}round {round_} (the coordinator may have restarted); push again",
                )
            started = self.clock()
            if not self.cond.wait_for(lambda: self.round > round_ or self.phase is Phase.FINISHED, timeout_s):
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"{self.label}round {round_} still open after {timeout_s:.0f}s")
            return self.clock() - started

    def state_proto(self) -> pb.FragmentState:
        return pb.FragmentState(index=self.index, round=self.round, checksum=self.checksum)

    @contextmanager
    def reading(
        self, delta_from_round: int | None = None, want_mean: bool = False
    ) -> Iterator[tuple[pb.ResultHeader, list[pb.TensorChunk] | None, list[pb.TensorChunk]]]:
        """The fragment's result header; the delta chunks when the caller can take a delta (else
        None: send values); the last round's mean pseudo-gradient chunks when asked (eager updates).

        Consistent while the context is held: the outer step waits for readers.
        """
        self.param_lock.acquire_read()
        try:
            with self.cond:
                header = pb.ResultHeader(
                    round=self.round,
                    checksum=self.checksum,
                    run_finished=self.owner.finished,
                    islands=self.last_islands,
                    mode=pb.ResultHeader.VALUES,
                    codec="fp32",
                    fragment=self.index,
                    tokens=self.last_tokens,
                )
                pub = self.publication
                delta = None
                if delta_from_round is not None and delta_from_round == self.round - 1 and pub.delta_base:
                    header.mode, header.codec, header.base_checksum = pb.ResultHeader.DELTA, pub.codec.name, pub.delta_base
                    delta = pub.delta_chunks
                mean = self.mean_chunks if want_mean and delta_from_round == self.round - 1 else []
            yield header, delta, mean
        finally:
            self.param_lock.release_read()

    # --- the round driver -----------------------------------------------------------

    def close_reason(self) -> str | None:
        """Why the current round may close now, or None. Caller holds cond."""
        self.owner.expire_leases()
        r = self.cfg.rounds
        done = [i for i, c in self.contributions.items() if c.state == "committed"]
        if not done:
            return None
        if len(done) >= r.max_islands:
            return "max_islands reached"
        if len(done) >= r.min_islands and all(i in done or i in self.dropped for i in self.owner.islands):
            return "every live island contributed"
        overdue = self.clock() - self.round_opened_at > r.deadline_s
        if overdue and len(done) >= r.min_islands:
            return "deadline"
        if overdue and self.clock() - self._last_wait_log > 10:
            self._last_wait_log = self.clock()
            log.warning(
                "%sround %d is past its %gs deadline with %d of min_islands=%d contributions; still waiting",
                self.label, self.round, r.deadline_s, len(done), r.min_islands,
            )
        return None

    def step_round(self, poll_s: float = 0.2) -> Closed | None:
        """Waits (up to poll_s) for the round to close; if it does, applies the outer step."""
        owner = self.owner
        with self.cond:
            if self.phase is Phase.FINISHED:
                return None
            reason = self.close_reason()
            if reason is None:
                self.cond.wait(poll_s)
                return None
            self.phase = Phase.CLOSING
            self.cond.wait_for(lambda: all(c.state != "folding" for c in self.contributions.values()))
            committed = {i: c for i, c in self.contributions.items() if c.state == "committed"}
            for island_id in [i for i, c in self.contributions.items() if c.state == "pending"]:
                log.warning("%sround %d: %s's contribution was incomplete; dropped", self.label, self.round, island_id)
                self.drop(island_id)
            owner.appends_pending += 1
        summary = self._summary(committed)
        # Step, publication and round change happen under the write lock, so no
        # reader ever sees new parameters under an old round number or the reverse.
        self.param_lock.acquire_write()
        try:
            mean = self.accumulator.mean()
            self.outer.step(mean)
            if self.cfg.streaming.eager:
                # Eager updates: islands build their provisional update from this (downlink codec, no feedback).
                self.mean_chunks = list(tensor_chunks(mean, self.publication.codec, self.cfg.wire.chunk_bytes))
            self.publication.publish()
            with self.cond:
                summary.checksum = self.checksum
                summary.seconds = self.clock() - self.round_opened_at
                for (round_, island_id), (up, down) in sorted(self.traffic.items()):
                    if round_ == self.round:
                        summary.traffic.add(island_id=island_id, bytes_up=up, bytes_down=down)
                        summary.bytes_up += up
                        summary.bytes_down += down
                self.traffic = {k: v for k, v in self.traffic.items() if k[0] > self.round}
                summary.dropped.extend(sorted(self.dropped))
                summary.elements_folded = self.elements_folded
                summary.elements_expected = self.manifest.total_numel() * len(committed)
                self.elements_folded = 0
                if self.restored_round is not None:
                    # First round closed since a restart: count what the restart cost.
                    owner.events.rounds_lost += max(0, self.max_round_seen - self.restored_round)
                    owner.events.recovery_s += self.clock() - self.restored_at
                    self.restored_round = None
                self.last_islands, self.last_tokens = len(committed), summary.tokens
                self.accumulator.reset()
                self.contributions.clear()
                self.dropped.clear()
                self.round += 1
                self.round_opened_at = self.clock()
                self.phase = Phase.FINISHED if self.round >= self.cfg.rounds.rounds else Phase.OPEN
                finisher = owner.finished
                total = owner.total_rounds_closed()
                self.cond.notify_all()
        finally:
            self.param_lock.release_write()
        log.info("%sround %d closed (%s) with %d islands", self.label, summary.round, reason, len(committed))
        # Evaluated once per wave, after fragment 0 (the last of a wave to sync), and at the end.
        if owner.evaluate and (finisher or (self.index == 0 and summary.round % self.cfg.eval.every_rounds == 0)):
            with owner.reading_all():
                summary.eval_loss = owner.evaluate(owner.params)
        with self.cond:
            if finisher:  # the run's last summary goes last, after every other fragment's
                self.cond.wait_for(lambda: owner.appends_pending == 1)
            summary.run_finished = finisher
            owner.summaries.append(summary)
            owner.appends_pending -= 1
            self.cond.notify_all()
        return Closed(summary, total, finisher)

    def _summary(self, committed: dict[str, Contribution]) -> pb.RoundSummary:
        tokens = sum(c.tokens for c in committed.values())
        n = len(committed)
        return pb.RoundSummary(
            round=self.round,
            islands=sorted(committed),
            tokens=tokens,
            train_loss=sum(c.train_loss * c.tokens for c in committed.values()) / tokens,
            eval_loss=math.nan,
            initial_eval_loss=self.owner.initial_eval_loss,
            # A ring all-reduce of fp32 gradients every inner step over the same islands (this fragment's share).
            ddp_bytes=2.0 * (n - 1) * 4 * self.manifest.total_numel() * self.cfg.inner.steps_per_round,
            fragment=self.index,
            fragments=self.cfg.streaming.fragments,
        )
