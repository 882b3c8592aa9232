"""The coordinator's state machine: membership, rounds, aggregation and the outer step.

Networking lives in service.py; this module takes calls and raises Refused with
the gRPC status a caller should see.

A round is OPEN while islands push; the driver thread moves it to CLOSING when
its close condition holds (every live island has contributed or was dropped,
max_islands have contributed, or the deadline passed with at least
min_islands), waits for folds in flight, applies the outer step, publishes the
result and opens the next round. After the last round the run is FINISHED.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch

from coordinator.locks import ReadWriteLock
from coordinator.publish import Publication
from coordinator.spool import Spool
from diloco.config import RunConfig
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import ChunkCorrupt, ChunkError, Coverage, Manifest, decode_chunk, downlink_codec, uplink_codec

log = logging.getLogger(__name__)

ACCEPTED_CHUNKS_KEY = "diloco-accepted-chunks"


class Refused(Exception):
    """A call the coordinator turns down; code is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = ()):
        super().__init__(message)
        self.code = code
        self.trailing = trailing


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    FINISHED = "finished"


@dataclass
class Island:
    island_id: str
    hostname: str
    shard: int
    last_seen: float
    final_checksum: str = ""
    # The replica groups of one island join under one key (empty: a one-group island).
    key: str = ""


@dataclass
class Contribution:
    """One island's pseudo-gradient for one round, possibly pushed over several streams."""

    tokens: int
    train_loss: float
    coverage: Coverage
    spools: list[Spool] = field(default_factory=list)
    state: str = "pending"  # pending -> folding -> committed


@dataclass
class Events:
    """Failures seen during the run, for the end-of-run summary."""

    leases_expired: int = 0
    dropped_nonfinite: int = 0
    checksum_resyncs: int = 0
    late_pushes: int = 0
    restarts: int = 0
    rounds_lost: int = 0
    recovery_s: float = 0.0


class CoordinatorState:
    def __init__(
        self,
        cfg: RunConfig,
        params: dict[str, torch.Tensor],
        spool_dir: Path,
        evaluate: Callable[[dict[str, torch.Tensor]], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.cfg = cfg
        self.codec = uplink_codec(cfg.wire)
        self.manifest = Manifest.of(params)
        self.outer = OuterOptimizer(params, cfg.outer)
        self.publication = Publication(params, downlink_codec(cfg.wire), cfg.wire.chunk_bytes)
        self.accumulator = PseudoGradientAccumulator(self.manifest.shapes)
        self.spool_dir = spool_dir
        self.evaluate = evaluate
        self.clock = clock
        self.cond = threading.Condition()
        self.param_lock = ReadWriteLock()
        self.fold_lock = threading.Lock()
        self.phase = Phase.OPEN
        self.round = 0
        self.round_opened_at = clock()
        self.islands: dict[str, Island] = {}
        self.departed: list[Island] = []
        self.joined = 0
        self.contributions: dict[str, Contribution] = {}
        self.dropped: set[str] = set()
        self.elements_folded = 0
        self.traffic: dict[tuple[int, str], list[int]] = {}  # (round, island) -> [up, down]
        self.summaries: list[pb.RoundSummary] = []
        self.events = Events()
        # Set by a restore: where the run restarted, and the latest round islands had reached.
        self.restored_round: int | None = None
        self.restored_at = 0.0
        self.max_round_seen = 0
        self.initial_eval_loss = evaluate(self.params) if evaluate else math.nan
        self._last_wait_log = 0.0

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The published global parameters: what every island holds."""
        return self.publication.params

    @property
    def checksum(self) -> str:
        return self.publication.checksum

    # --- membership -------------------------------------------------------------

    def join(self, hostname: str, island_id: str = "", key: str = "") -> Island:
        """Admits an island into the current round; a known island_id rejoins as itself.

        With a key, a live island that joined under the same key is returned
        (another replica group of it, or one that restarted).
        """
        with self.cond:
            if self.phase is Phase.FINISHED:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "the run has finished; nothing to join")
            self._expire_leases()
            if key and not (island_id and island_id in self.islands):
                island_id = next((i.island_id for i in self.islands.values() if i.key == key), island_id)
            if island_id and island_id in self.islands:
                island = self.islands[island_id]
                island.last_seen = self.clock()
                log.info("%s rejoined from %s at round %d", island_id, hostname, self.round)
                return island
            if len(self.islands) >= self.cfg.rounds.max_islands:
                raise Refused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"run is full: {len(self.islands)} islands (rounds.max_islands={self.cfg.rounds.max_islands})",
                )
            island = Island(f"island-{self.joined}", hostname, self.joined % self.cfg.data.shards, self.clock(), key=key)
            self.joined += 1
            self.islands[island.island_id] = island
            log.info("%s joined from %s at round %d (shard %d)", island.island_id, hostname, self.round, island.shard)
            self.cond.notify_all()
            return island

    def touch(self, island_id: str) -> Island:
        with self.cond:
            island = self.islands.get(island_id)
            if island is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown island {island_id!r} (lease expired?); join again")
            island.last_seen = self.clock()
            return island

    def leave(self, island_id: str, island_checksum: str) -> bool:
        with self.cond:
            island = self.islands.pop(island_id, None)
            matches = island_checksum == self.checksum
            if island is not None:
                island.final_checksum = island_checksum
                self.departed.append(island)
                log.info("%s left; checksum %s", island_id, "matches" if matches else "DIFFERS")
                if island_id in self.contributions and self.contributions[island_id].state == "pending":
                    self._drop(island_id)
            self.cond.notify_all()
            return matches

    def _expire_leases(self) -> None:
        now = self.clock()
        for island_id, island in list(self.islands.items()):
            if now - island.last_seen > self.cfg.rounds.lease_s:
                log.warning("%s missed its %.1fs lease; removed from the run", island_id, self.cfg.rounds.lease_s)
                self.events.leases_expired += 1
                del self.islands[island_id]
                contribution = self.contributions.get(island_id)
                if contribution is not None and contribution.state == "pending":
                    self._drop(island_id)

    # --- pushes -----------------------------------------------------------------

    def begin_push(self, header: pb.PushHeader) -> None:
        """Checks a push's header before any chunk is read."""
        self.touch(header.island_id)
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, header.round)
            if self.phase is Phase.FINISHED:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "the run has finished")
            if header.round != self.round or self.phase is not Phase.OPEN:
                self.events.late_pushes += 1
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"round {header.round} is closed (current round {self.round}); "
                    "fetch the global parameters and train for the current round",
                )
            if header.island_id in self.dropped:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{header.island_id} was dropped from round {self.round}")
            if header.codec != self.codec.name:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"codec {header.codec!r} does not match the run's {self.codec.name!r}")
            if header.tokens <= 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"tokens must be positive, got {header.tokens}")
            if header.global_checksum and header.global_checksum != self.checksum:
                self.events.checksum_resyncs += 1
                log.warning(
                    "%s trained round %d from global parameters with checksum %s, not the coordinator's %s; "
                    "it must resync", header.island_id, self.round, header.global_checksum[:12], self.checksum[:12],
                )
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "your global parameters differ from the coordinator's (checksum mismatch); fetch them again",
                )
            existing = self.contributions.get(header.island_id)
            if existing is not None and existing.state != "pending":
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"{header.island_id} already contributed to round {self.round}")
            if existing is not None and existing.tokens != header.tokens:
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tokens {header.tokens} differ from {existing.tokens} sent earlier for this round",
                )

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        """Spools one push stream; folds the contribution into the aggregate once it is whole.

        A broken stream or a bad chunk discards this stream's spool, so the
        aggregate never sees part of a contribution. A corrupt chunk keeps the
        chunks before it and tells the island how many to skip when it resends.
        """
        self.begin_push(header)
        spool: Spool | None = Spool(self.spool_dir)
        ranges: list[tuple[str, int, int]] = []
        try:
            for chunk in chunks:
                try:
                    values = decode_chunk(chunk, self.manifest, self.codec)
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
                self._drop(header.island_id)
            self.dropped.add(header.island_id)
            self.events.dropped_nonfinite += 1
            self.cond.notify_all()
        log.error(
            "%s pushed a pseudo-gradient with NaN/Inf in %s (elements %d..%d); dropped from round %d",
            header.island_id, chunk.name, chunk.offset, chunk.offset + chunk.numel, header.round,
        )
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"pseudo-gradient is not finite in {chunk.name}; dropped from round {header.round}: resync and go on",
        )

    def _attach(self, header: pb.PushHeader, spool: Spool, ranges: list[tuple[str, int, int]]) -> pb.PushResponse:
        spool.close()
        with self.cond:
            if header.round != self.round or self.phase is not Phase.OPEN:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"round {header.round} closed while the push was in flight")
            if header.island_id not in self.islands or header.island_id in self.dropped:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"{header.island_id} left round {header.round} while pushing")
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
            log.info("round %d: %s contributed %d tokens", header.round, header.island_id, header.tokens)
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

    def _drop(self, island_id: str) -> None:
        contribution = self.contributions.pop(island_id)
        for spool in contribution.spools:
            spool.discard()

    def _count(self, round_: int, island_id: str, up: int = 0, down: int = 0) -> None:
        with self.cond:
            entry = self.traffic.setdefault((round_, island_id), [0, 0])
            entry[0] += up
            entry[1] += down

    def count_down(self, round_: int, island_id: str, n: int) -> None:
        self._count(round_, island_id, down=n)

    # --- reading the parameters ---------------------------------------------------

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float) -> None:
        """Blocks until round_ has closed. Refuses at once if the island's push is not here."""
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, round_)
            if round_ > self.round:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"round {round_} is ahead of the coordinator's round {self.round} (it restarted from a checkpoint); resync",
                )
            if self.round == round_ and self.phase is Phase.OPEN and island_id not in self.contributions:
                raise Refused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no contribution from {island_id} in round {round_} (the coordinator may have restarted); push again",
                )
            if not self.cond.wait_for(lambda: self.round > round_ or self.phase is Phase.FINISHED, timeout_s):
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED, f"round {round_} still open after {timeout_s:.0f}s")

    @contextmanager
    def reading(self, delta_from_round: int | None = None) -> Iterator[tuple[pb.ResultHeader, list[pb.TensorChunk] | None]]:
        """The result header and, when the caller can take a delta, the delta chunks (else None: send values).

        Consistent while the context is held: the outer step waits for readers.
        """
        self.param_lock.acquire_read()
        try:
            with self.cond:
                header = pb.ResultHeader(
                    round=self.round,
                    checksum=self.checksum,
                    run_finished=self.phase is Phase.FINISHED,
                    islands=len(self.summaries[-1].islands) if self.summaries else 0,
                    mode=pb.ResultHeader.VALUES,
                    codec="fp32",
                )
                pub = self.publication
                delta = None
                if delta_from_round is not None and delta_from_round == self.round - 1 and pub.delta_base:
                    header.mode, header.codec, header.base_checksum = pb.ResultHeader.DELTA, pub.codec.name, pub.delta_base
                    delta = pub.delta_chunks
            yield header, delta
        finally:
            self.param_lock.release_read()

    # --- the round driver -----------------------------------------------------------

    def close_reason(self) -> str | None:
        """Why the current round may close now, or None. Caller holds cond."""
        self._expire_leases()
        r = self.cfg.rounds
        done = [i for i, c in self.contributions.items() if c.state == "committed"]
        if not done:
            return None
        if len(done) >= r.max_islands:
            return "max_islands reached"
        if len(done) >= r.min_islands and all(i in done or i in self.dropped for i in self.islands):
            return "every live island contributed"
        overdue = self.clock() - self.round_opened_at > r.deadline_s
        if overdue and len(done) >= r.min_islands:
            return "deadline"
        if overdue and self.clock() - self._last_wait_log > 10:
            self._last_wait_log = self.clock()
            log.warning(
                "round %d is past its %gs deadline with %d of min_islands=%d contributions; still waiting",
                self.round, r.deadline_s, len(done), r.min_islands,
            )
        return None

    def step_round(self, poll_s: float = 0.2) -> pb.RoundSummary | None:
        """Waits (up to poll_s) for the round to close; if it does, applies the outer step."""
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
                log.warning("round %d: %s's contribution was incomplete; dropped", self.round, island_id)
                self._drop(island_id)
        summary = self._summary(committed)
        # Step, publication and round change happen under the write lock, so no
        # reader ever sees new parameters under an old round number or the reverse.
        self.param_lock.acquire_write()
        try:
            self.outer.step(self.accumulator.mean())
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
                    self.events.rounds_lost += max(0, self.max_round_seen - self.restored_round)
                    self.events.recovery_s += self.clock() - self.restored_at
                    self.restored_round = None
                self.accumulator.reset()
                self.contributions.clear()
                self.dropped.clear()
                self.round += 1
                self.round_opened_at = self.clock()
                self.phase = Phase.FINISHED if self.round >= self.cfg.rounds.rounds else Phase.OPEN
                summary.run_finished = self.phase is Phase.FINISHED
                self.cond.notify_all()
        finally:
            self.param_lock.release_write()
        log.info("round %d closed (%s) with %d islands", summary.round, reason, len(committed))
        if self.evaluate and (summary.run_finished or summary.round % self.cfg.eval.every_rounds == 0):
            self.param_lock.acquire_read()
            try:
                summary.eval_loss = self.evaluate(self.params)
            finally:
                self.param_lock.release_read()
        with self.cond:
            self.summaries.append(summary)
            self.cond.notify_all()
        return summary

    def _summary(self, committed: dict[str, Contribution]) -> pb.RoundSummary:
        tokens = sum(c.tokens for c in committed.values())
        n = len(committed)
        return pb.RoundSummary(
            round=self.round,
            islands=sorted(committed),
            tokens=tokens,
            train_loss=sum(c.train_loss * c.tokens for c in committed.values()) / tokens,
            eval_loss=math.nan,
            initial_eval_loss=self.initial_eval_loss,
            # A ring all-reduce of fp32 gradients every inner step over the same islands.
            ddp_bytes=2.0 * (n - 1) * 4 * self.manifest.total_numel() * self.cfg.inner.steps_per_round,
        )

    def watch(self, from_round: int, stop: threading.Event) -> Iterator[pb.RoundSummary]:
        index = 0
        while not stop.is_set():
            with self.cond:
                self.cond.wait_for(lambda: len(self.summaries) > index or stop.is_set(), 0.5)
                pending = self.summaries[index:]
                index = len(self.summaries)
            for s in pending:
                if s.round >= from_round:
                    yield s
                if s.run_finished:
                    return
