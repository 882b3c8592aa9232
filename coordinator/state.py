"""The coordinator's state: membership, the fragments' round machines, the run's history.

Networking lives in service.py; this module takes calls and raises Refused with
the gRPC status a caller should see.

The model's parameters are split into fragments (diloco/fragments.py; one
fragment holding everything without streaming), each with its own round
sequence in coordinator/fragment.py. What is shared lives here: the islands
and their leases, the condition variable every wait uses, the failure counts
and the round summaries. The run is FINISHED when every fragment is.

Without streaming, the attributes of the one fragment are also reachable
here (round, phase, outer, publication, accumulator, contributions, ...).
"""

from __future__ import annotations

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

from coordinator.fragment import ACCEPTED_CHUNKS_KEY, Closed, FragmentRounds, Phase, Refused
from diloco.config import RunConfig
from diloco.fragments import layout_for
from diloco.params import checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest, uplink_codec

log = logging.getLogger(__name__)

__all__ = ["ACCEPTED_CHUNKS_KEY", "Closed", "CoordinatorState", "Events", "Island", "Phase", "Refused"]


@dataclass
class Island:
    island_id: str
    hostname: str
    shard: int
    last_seen: float
    final_checksum: str = ""
    # The replica groups of one island join under one key (empty: a one-group island).
    key: str = ""
    # What the island reported when it left: compute_s, wait_s, wall_s, inner_steps.
    stats: dict = field(default_factory=dict)


@dataclass
class Events:
    """Failures seen during the run, for the end-of-run summary."""

    leases_expired: int = 0
    dropped_nonfinite: int = 0
    checksum_resyncs: int = 0
    late_pushes: int = 0
    restarts: int = 0  # of the coordinator
    rounds_lost: int = 0
    recovery_s: float = 0.0  # coordinator restarts: from restore to the first round closed again
    island_restarts: int = 0  # an island came back under its own id (e.g. `join --resume`) while still a member
    island_silent_s: float = 0.0  # those islands' silence before they came back: last heartbeat to rejoin


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
        self.layout = layout_for(self.manifest.shapes, cfg)
        self.spool_dir = spool_dir
        self.evaluate = evaluate
        self.clock = clock
        self.cond = threading.Condition()
        self.islands: dict[str, Island] = {}
        self.departed: list[Island] = []
        self.joined = 0
        self.summaries: list[pb.RoundSummary] = []
        self.appends_pending = 0  # rounds closed whose summary is not in summaries yet
        self.events = Events()
        self.fragments = [FragmentRounds(self, f.index, self.layout.subset(f.index, params)) for f in self.layout]
        # The published parameters of every fragment, in manifest order (the same tensors).
        self._params = {n: self.fragments[self.layout.fragment_of(n)].publication.params[n] for n in self.manifest.shapes}
        self._whole: tuple[tuple[str, ...], str] | None = None
        if len(self.fragments) > 1:
            log.info("streaming: %s", self.layout.describe())
        self.initial_eval_loss = evaluate(self.params) if evaluate else math.nan

    # --- the run as a whole ---------------------------------------------------------

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The published global parameters: what every island holds."""
        return self._params

    @property
    def outer_params(self) -> dict[str, torch.Tensor]:
        """The outer optimizers' full-precision parameters, every fragment."""
        return {n: t for f in self.fragments for n, t in f.outer.params.items()}

    @property
    def checksum(self) -> str:
        """Checksum of the whole published model. With several fragments it takes their read locks:
        never call it holding cond or a fragment's lock (use whole_checksum_locked then)."""
        if len(self.fragments) == 1:
            return self.fragments[0].checksum
        with self.reading_all():
            return self.whole_checksum_locked()

    def whole_checksum_locked(self) -> str:
        """The whole model's checksum; the caller holds every fragment's read lock (or nothing changes)."""
        if len(self.fragments) == 1:
            return self.fragments[0].checksum
        key = tuple(f.checksum for f in self.fragments)
        if self._whole is None or self._whole[0] != key:
            self._whole = (key, checksum(self._params))
        return self._whole[1]

    @property
    def finished(self) -> bool:
        return all(f.phase is Phase.FINISHED for f in self.fragments)

    @property
    def phase(self) -> Phase:
        """FINISHED once every fragment is; else fragment 0's phase."""
        return Phase.FINISHED if self.finished else self.fragments[0].phase

    @property
    def round(self) -> int:
        """Fragment 0's round (the run's round without streaming)."""
        return self.fragments[0].round

    def total_rounds_closed(self) -> int:
        return sum(f.round for f in self.fragments)

    def fragment(self, index: int) -> FragmentRounds:
        if not 0 <= index < len(self.fragments):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fragment {index} does not exist: the run has {len(self.fragments)} (streaming.fragments)",
            )
        return self.fragments[index]

    @contextmanager
    def reading_all(self) -> Iterator[None]:
        """Every fragment's read lock (in index order): a consistent view of the whole model."""
        taken = []
        try:
            for f in self.fragments:
                f.param_lock.acquire_read()
                taken.append(f)
            yield
        finally:
            for f in reversed(taken):
                f.param_lock.release_read()

    @contextmanager
    def reading(self) -> Iterator[pb.ResultHeader]:
        """The whole model's result header (for values): every fragment's round and checksum in it."""
        with self.reading_all():
            whole = self.whole_checksum_locked()
            with self.cond:
                first = self.fragments[0]
                header = pb.ResultHeader(
                    round=first.round, checksum=whole, run_finished=self.finished, islands=first.last_islands,
                    mode=pb.ResultHeader.VALUES, codec="fp32", tokens=first.last_tokens,
                    fragments=[f.state_proto() for f in self.fragments],
                )
            yield header

    # --- without streaming: the one fragment's state, as before --------------------------

    @property
    def outer(self):
        return self.fragments[0].outer

    @property
    def publication(self):
        return self.fragments[0].publication

    @property
    def accumulator(self):
        return self.fragments[0].accumulator

    @property
    def contributions(self):
        return self.fragments[0].contributions

    @property
    def traffic(self):
        return self.fragments[0].traffic

    # --- membership -------------------------------------------------------------

    def join(self, hostname: str, island_id: str = "", key: str = "") -> Island:
        """Admits an island into the current round; a known island_id rejoins as itself.

        With a key, a live island that joined under the same key is returned
        (another replica group of it, or one that restarted).
        """
        with self.cond:
            if self.finished:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "the run has finished; nothing to join")
            self.expire_leases()
            explicit_id = bool(island_id) and island_id in self.islands
            if key and not (island_id and island_id in self.islands):
                island_id = next((i.island_id for i in self.islands.values() if i.key == key), island_id)
            if island_id and island_id in self.islands:
                island = self.islands[island_id]
                if explicit_id:  # a restarted island presenting its own id, not another replica group by key
                    self.events.island_restarts += 1
                    self.events.island_silent_s += self.clock() - island.last_seen
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

    def leave(self, island_id: str, island_checksum: str, stats: dict | None = None) -> bool:
        matches = island_checksum == self.checksum  # outside cond: it may take the fragments' read locks
        with self.cond:
            island = self.islands.pop(island_id, None)
            if island is not None:
                island.final_checksum = island_checksum
                island.stats = dict(stats or {})
                self.departed.append(island)
                log.info("%s left; checksum %s", island_id, "matches" if matches else "DIFFERS")
                for f in self.fragments:
                    f.drop_pending(island_id)
            self.cond.notify_all()
            return matches

    def expire_leases(self) -> None:
        """Removes islands whose lease ran out (and their half-pushed contributions). Caller holds cond."""
        now = self.clock()
        for island_id, island in list(self.islands.items()):
            if now - island.last_seen > self.cfg.rounds.lease_s:
                log.warning("%s missed its %.1fs lease; removed from the run", island_id, self.cfg.rounds.lease_s)
                self.events.leases_expired += 1
                del self.islands[island_id]
                for f in self.fragments:
                    f.drop_pending(island_id)

    # --- calls for one fragment (fragment 0 without streaming) ---------------------------

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        return self.fragment(header.fragment).receive(header, chunks)

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float, fragment: int = 0) -> float:
        return self.fragment(fragment).wait_for_result(island_id, round_, timeout_s)

    def count_down(self, round_: int, island_id: str, n: int, fragment: int = 0) -> None:
        self.fragment(fragment).count_down(round_, island_id, n)

    def step_round(self, poll_s: float = 0.2, fragment: int = 0) -> Closed | None:
        """One fragment's driver step (see FragmentRounds.step_round)."""
        return self.fragments[fragment].step_round(poll_s)

    # --- watching -------------------------------------------------------------------

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
