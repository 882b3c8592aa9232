"""The coordinator's state: membership, the fragments' round machines, the run's history.

Networking lives in service.py; this module takes calls and raises Refused with
a typed reason (diloco/wire/refusal.py).

The model's parameters are split into fragments (diloco/fragments.py; one
fragment holding everything without streaming), each with its own round
sequence in coordinator/rounds.py. What is shared lives here: membership
(coordinator/membership.py), the condition variable every wait uses, the round
summaries and the evaluation of the global parameters. The run is FINISHED when
every fragment is.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from coordinator import hooks
from coordinator.filebacked import HandingBack
from coordinator.ledger import DataLedger, account_dict
from coordinator.limits import PushSlots
from coordinator.links import LinkAdvisor
from coordinator.membership import Events, Island, Membership
from coordinator.memory import state_memory
from coordinator.publish import Reading
from coordinator.rounds import Closed, Closing, FragmentContext, FragmentRounds, Phase
from coordinator.spool import Spools
from diloco.config import RunConfig
from diloco.fragments import FragmentLayout, layout_for
from diloco.params import checksum, ranges_checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import FlatRange, Manifest, link_codecs, uplink_codec
from diloco.wire.refusal import Reason, Refused

log = logging.getLogger(__name__)

__all__ = ["Closed", "CoordinatorState", "Events", "Island", "Phase", "Refused"]


class CoordinatorState:
    def __init__(
        self,
        cfg: RunConfig,
        params: dict[str, torch.Tensor],
        spool_dir: Path,
        evaluate: Callable[[dict[str, torch.Tensor]], float] | None = None,
        tasks: Callable[[dict[str, torch.Tensor]], dict[str, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        ledger: DataLedger | None = None,
        data_digest: str = "",
        revoked: Callable[[str], bool] = lambda owner: False,
        record: Callable[..., None] = lambda event, **fields: None,
        layout: FragmentLayout | None = None,
        model: tuple[Manifest, FragmentLayout] | None = None,
        judge: Callable | None = None,
        sketch_secret: bytes | None = None,
        followers=None,
        follows_leader: bool = False,
    ):
        """params: the global parameters this process holds (a shard's part of them, docs/sharding.md); layout:
        their fragments (a shard's: ShardMap.restrict), else the run's over params; model: the whole model's manifest
        and layout, which a shard tells joining islands (default: its own); judge, sketch_secret, follows_leader: a
        shard's (FragmentContext; coordinator/judging.py); followers: a leading shard's
        view of the others' rounds (coordinator/gather.py FollowerRounds), which makes its summaries the run's."""
        self.cfg = cfg
        self.codec = uplink_codec(cfg.wire)
        self.manifest = Manifest.of(params)
        self.layout = layout or layout_for(self.manifest.shapes, cfg)
        self.model = model or (self.manifest, self.layout)
        self.spool_dir = spool_dir
        self.evaluate = evaluate
        self.tasks = tasks  # downstream task scores (diloco/models/evaluation.py), every eval.tasks_every_rounds rounds
        self.clock = clock
        # A token corpus: who trains on which samples (coordinator/ledger.py), and the corpus's digest.
        self.ledger, self.data_digest = ledger, data_digest
        self.cond = threading.Condition()
        r = cfg.rounds
        self.members = Membership(r.max_islands, cfg.data.shards, r.lease_s, self.cond, clock, on_leave=self._drop_pending,
                                  revoked=revoked, record=record, idle_rounds=cfg.limits.idle_rounds * cfg.streaming.fragments,
                                  departed_kept=cfg.limits.departed_kept, on_replace=self._drop_replaced)
        self.summaries: list[pb.RoundSummary] = []
        self.followers = followers
        # Compression per link (coordinator/links.py): the codecs islands may push with, and who advises which.
        codecs = link_codecs(cfg.wire)
        advised = list(codecs.values())[:len(cfg.wire.link_codecs)]
        self.links = LinkAdvisor(advised, cfg.wire.link_fraction) if advised else None
        # Pushes wait in memory up to limits.spool_memory_models fp32 models, then on disk (coordinator/spool.py).
        self.spools = spools = Spools(spool_dir, int(cfg.limits.spool_gb * 1e9),
                                      int(4 * self.manifest.total_numel() * cfg.limits.spool_memory_models), cfg.wire.chunk_bytes)
        # At most limits.push_slots pushes read at once, each island its share (coordinator/limits.py).
        self.push_slots = PushSlots(cfg.limits.push_slots, lambda: len(self.members.islands))
        ctx = FragmentContext(
            cfg, self.codec, self.cond, clock, spools, self.members,
            run_finished=lambda: self.finished, rounds_closed=self.total_rounds_closed, fragment_of=self._fragment_of,
            ledger=ledger, codecs=codecs, links=self.links,
            # Every fragment's folds and publications share the cores (threads start on first use, idle between rounds).
            pool=ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="close"),
            judge=judge, sketch_secret=sketch_secret, follows_leader=follows_leader,
        )
        self.fragments = [FragmentRounds(ctx, f.index, self.layout.subset(f.index, params)) for f in self.layout]
        self.hooks = ctx.hooks  # what each close does besides the round itself (coordinator/hooks.py; server.py adds)
        # The published parameters of every fragment, in manifest order (the same tensors).
        self._params = {n: self.fragments[self.layout.fragment_of(n)].publication.params[n] for n in self.manifest.shapes}
        self._whole: tuple[tuple[str, ...], str] | None = None
        if len(self.fragments) > 1:
            log.info("streaming: %s", self.layout.describe())
        self.initial_eval_loss = self.read_whole(evaluate) if evaluate else math.nan
        # Evaluation, summaries, memory sampling, the eager mean, ledger settlement and membership, around each close;
        # the most each part of memory held, sampled by them (coordinator/memory.py).
        self.memory_peaks = hooks.register(self.hooks, self).peaks

    def _fragment_of(self, name: str) -> int | None:
        return self.layout.fragment_of(name) if name in self.manifest.shapes else None

    def _drop_pending(self, island_id: str) -> None:
        """An island left or its lease expired (caller holds cond)."""
        for f in self.fragments:
            f.drop_pending(island_id)
        if self.ledger is not None:  # one whose lease ran out may come back as itself: it keeps the lease it is on
            self.ledger.release(island_id, keep_current=island_id in self.members.expired)

    def _drop_replaced(self, island_id: str) -> None:
        """Another process became the island (caller holds cond): what the old one half-pushed goes; its leases stay,
        for the new one to go on with (a resumed island asks for them again)."""
        for f in self.fragments:
            f.drop_pending(island_id)

    def canonical_members(self) -> list[str]:
        with self.cond:
            return self.members.order(self.members.islands)

    # --- membership (coordinator/membership.py) ----------------------------------------------

    @property
    def islands(self) -> dict[str, Island]:
        return self.members.islands

    @property
    def departed(self) -> list[Island]:
        return self.members.departed

    @property
    def events(self) -> Events:
        return self.members.events

    def join(self, hostname: str, island_id: str = "", key: str = "", owner: str | None = None, ranks: int = 1,
             assigned: bool = False, instance: str = "", peer: str = "", replaced: list[str] | None = None) -> Island:
        """Admits an island into the current round; a known island_id rejoins as itself (assigned, instance, peer,
        replaced: see Membership.join)."""
        return self.members.join(hostname, island_id, key, run_finished=self.finished, round_=self.round, owner=owner,
                                 ranks=ranks, assigned=assigned, instance=instance, peer=peer, replaced=replaced)

    def touch(self, island_id: str) -> Island:
        return self.members.touch(island_id)

    def leave(self, island_id: str, island_checksum: str, stats: dict | None = None,
              fragment_checksums: list[str] | None = None, untrained: list[tuple[int, int]] = ()) -> tuple[bool, str]:
        """An island leaves holding island_checksum (or, per fragment, fragment_checksums); returns whether
        that is the coordinator's, and the coordinator's whole checksum."""
        whole = self.checksum  # outside cond: it may take the fragments' read locks
        if fragment_checksums:
            with self.cond:
                matches = fragment_checksums == [f.checksum for f in self.fragments]
            island_checksum = whole if matches else "fragments differ: " + ",".join(c[:12] for c in fragment_checksums)
        else:
            matches = island_checksum == whole
        if self.ledger is not None and untrained:  # before leaving, which gives back what no push of it named
            n = self.ledger.give_back(island_id, list(untrained))
            log.info("%s handed back %d untrained samples", island_id, n)
        self.members.leave(island_id, island_checksum, stats, matches)
        return matches, whole

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
            self._whole = (key, checksum(self._params, None if self._in_memory() else self._release))
        return self._whole[1]

    def _in_memory(self) -> bool:
        """The published parameters are the outer optimizers' (a lossless downlink), not file-backed copies."""
        return all(f.publication.file is None for f in self.fragments)

    def _release(self, name: str, lo: int = 0, hi: int | None = None) -> None:
        self.fragments[self.layout.fragment_of(name)].publication.release(name, lo, hi)

    def read_whole(self, read: Callable[[Mapping[str, torch.Tensor]], Any]) -> Any:
        """read(the published parameters); file-backed ones (a lossy downlink's, coordinator/filebacked.py) are handed
        back a tensor at a time as read reads on (diloco/params.py load_parameters)."""
        if self._in_memory():
            return read(self._params)
        try:
            return read(HandingBack(self._params, self._release))
        finally:  # what read kept hold of and read again (a sharded leader's gathered whole)
            for f in self.fragments:
                f.publication.release()

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

    @property
    def publication(self):
        """Fragment 0's publication (its downlink codec is the run's)."""
        return self.fragments[0].publication

    def total_rounds_closed(self) -> int:
        return sum(f.round for f in self.fragments)

    def fragment(self, index: int) -> FragmentRounds:
        if not 0 <= index < len(self.fragments):
            raise Refused(Reason.BAD_REQUEST, f"fragment {index} does not exist: the run has {len(self.fragments)} (streaming.fragments)")
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
    def reading(self, ranges: list[FlatRange] | None = None, cancel: Callable[[], None] = lambda: None) -> Iterator[Reading]:
        """The whole model's values (publish.py Reading): every fragment's round and checksum in the header (with
        ranges, their checksum too), and every fragment's value messages. Taken under every fragment's read lock,
        held only while it is taken; sent without it (FragmentRounds.reading says why, and what cancel is)."""
        with self.reading_all():
            whole = self.whole_checksum_locked()
            with self.cond:
                first = self.fragments[0]
                header = pb.ResultHeader(
                    round=first.round, checksum=whole, run_finished=self.finished, islands=first.last_islands,
                    mode=pb.ResultHeader.VALUES, codec="fp32", tokens=first.last_tokens,
                    fragments=[f.state_proto() for f in self.fragments],
                )
            if ranges is not None:
                header.ranges_checksum = ranges_checksum(
                    (r.name, r.offset, self.params[r.name].view(-1)[r.offset : r.end]) for r in ranges)
            reading = Reading(header)
            for f in self.fragments:
                reading.add_values(f.publication, cancel)
        try:
            yield reading
        finally:
            reading.done()

    # --- memory ---------------------------------------------------------------------

    def memory(self, closing: tuple[int, Closing] | None = None) -> dict[str, int]:
        """The bytes each long-lived part of the coordinator holds now (coordinator/memory.py COMPONENTS, every
        fragment's summed; a tensor's storage counted once); closing: (fragment, what it is closing), whose
        contributions the fragment no longer holds itself. Takes no lock: it reads what the driver may be changing,
        so a figure taken mid-close is that moment's."""
        return state_memory(self, closing)

    def memory_pool(self) -> dict[str, int]:
        """The spool's memory pool: the blocks allocated, those spools hold now, and the most it allocates."""
        pool = self.spools.pool
        return {"allocated": pool.allocated_bytes, "in_use": pool.in_use_bytes, "capacity": pool.capacity_bytes}

    def memory_report(self) -> dict:
        """memory() now, its peaks over the run (MemoryPeaks), the pool, and the fp32 model's bytes to compare with."""
        return {"now": self.memory(), **self.memory_peaks.report(), "spool_pool": self.memory_pool(),
                "model_fp32_bytes": 4 * self.manifest.total_numel(),
                "values_on_disk": sum(f.publication.held_values()["values_on_disk"] for f in self.fragments),
                "published_on_disk": sum(f.publication.file.nbytes for f in self.fragments if f.publication.file is not None)}

    # --- calls for one fragment (fragment 0 without streaming) ---------------------------

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        return self.fragment(header.fragment).receive(header, chunks)

    def wait_for_result(self, island_id: str, round_: int, timeout_s: float, fragment: int = 0, ranges=None,
                        interrupted: Callable[[], bool] = lambda: False) -> float:
        return self.fragment(fragment).wait_for_result(island_id, round_, timeout_s, ranges, interrupted)

    def count_down(self, round_: int, island_id: str, n: int, fragment: int = 0) -> None:
        self.fragment(fragment).count_down(round_, island_id, n)

    def advise_codec(self, island_id: str, fragment: int, round_: int) -> str:
        """The codec island_id should push round_ of fragment with (wire.link_codecs); "" to keep its own."""
        if self.links is None:
            return ""
        f = self.fragment(fragment)
        round_s = self.cfg.rounds.round_s if self.cfg.rounds.mode == "time" else f.last_round_s
        return self.links.advise(island_id, fragment, round_, f.manifest.total_numel(), round_s)

    # --- the run as a whole, at its end -------------------------------------------------

    def data_report(self) -> dict | None:
        """The token corpus's account at the end (per fragment, in tokens); None without a corpus."""
        if self.ledger is None:
            return None
        with self.cond:
            live = self.members.live()
        per = [account_dict(self.ledger.account(f.index, live)) for f in self.fragments]
        for a in per:
            del a["folded_this_round"], a["samples"]
        return {"tokens_trained": min(a["folded"] for a in per), "tokens_lost": max(a["lost"] for a in per),
                "tokens_repeated": sum(a["repeated"] for a in per), "tokens_returned": per[0]["returned"],
                "tokens_leased": per[0]["leased"], "fragments": per}

    # --- watching -------------------------------------------------------------------

    def watch(self, from_round: int, stop: threading.Event, active: Callable[[], bool] = lambda: True,
              check: Callable[[], None] = lambda: None) -> Iterator[pb.RoundSummary]:
        """Round summaries from from_round on, until the run finishes, stop is set or the caller is gone (active).
        check() runs at least every half second: it raises to end the watch (the caller was revoked)."""
        index = 0
        while not stop.is_set() and active():
            check()
            with self.cond:
                self.cond.wait_for(lambda: len(self.summaries) > index or stop.is_set(), 0.5)
                pending = self.summaries[index:]
                index = len(self.summaries)
            for s in pending:
                if s.round >= from_round:
                    yield s
                if s.run_finished:
                    return
