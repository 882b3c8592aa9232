"""A fragment's intake of pushes: the header's checks, chunks spooled as they arrive, contributions made whole.

A mixin of FragmentRounds (coordinator/fragment.py), kept apart so each file
reads in one sitting: it uses the fragment's round, phase, manifest, codec,
members and contributions, and never closes a round.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import numpy as np

from coordinator.ledger import ranges_of
from coordinator.records import Contribution, Phase, Reason, Refused, check_claim, lr_sum
from coordinator.spool import Spool
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import ChunkCorrupt, ChunkError, Coverage, framed_size, verify_chunk

log = logging.getLogger("coordinator.fragment")


class PushIntake:
    def begin_push(self, header: pb.PushHeader) -> None:
        """Checks a push's header before any chunk is read."""
        island = self.members.touch(header.island_id)
        if self.cfg.robust.enabled and self.cfg.robust.check_claims:
            check_claim(header, self.cfg, island.ranks)
        with self.cond:
            self.max_round_seen = max(self.max_round_seen, header.round)
            if self.phase is Phase.FINISHED:
                raise Refused(Reason.RUN_FINISHED, f"the run has finished{' for ' + self.label.strip() if self.label else ''}")
            late = self.lateness(header.round, "is closed")
            if header.island_id in self.dropped:
                raise Refused(Reason.DROPPED, f"{header.island_id} was dropped from {self.label}round {self.round}")
            if header.codec not in self.push_codecs:
                raise Refused(Reason.CODEC_MISMATCH, f"codec {header.codec!r} is not one the run takes ({', '.join(self.push_codecs)})")
            if header.tokens < 0:
                raise Refused(Reason.BAD_REQUEST, f"tokens must be >= 0, got {header.tokens}")
            if not math.isfinite(header.train_loss):  # it would make the round's reported loss NaN
                raise Refused(Reason.NOT_FINITE, f"train_loss {header.train_loss} is not finite: resync and go on")
            # A late push was trained from the parameters its own round started from.
            trained_from = self.published.get(header.round, "") if late else self.checksum
            if not header.global_checksum:  # it would skip the check below: trained from parameters nobody can name
                raise Refused(Reason.BAD_REQUEST, "the push names no global_checksum (of the global parameters it was trained "
                              "from): fetch the global parameters and push with their checksum")
            if header.global_checksum != trained_from:
                self.members.events.checksum_resyncs += 1
                log.warning(
                    "%s trained %sround %d from global parameters with checksum %s, not the coordinator's %s; "
                    "it must resync", header.island_id, self.label, header.round, header.global_checksum[:12], trained_from[:12],
                )
                raise Refused(
                    Reason.CHECKSUM_MISMATCH,
                    "your global parameters differ from the coordinator's (checksum mismatch); fetch them again",
                )
            existing = self.late.get((header.island_id, header.round)) if late else self.contributions.get(header.island_id)
            if existing is not None and existing.state != "pending":
                raise Refused(Reason.DUPLICATE, f"{header.island_id} already contributed to {self.label}round {header.round}")
            if existing is not None and existing.tokens != header.tokens:
                raise Refused(Reason.BAD_REQUEST, f"tokens {header.tokens} differ from {existing.tokens} sent earlier for this round")
        if self.ctx.ledger is not None:
            self.ctx.ledger.check(header.island_id, self.index, ranges_of(header.samples), header.tokens)

    @property
    def push_codecs(self) -> dict:
        """The codecs pushes may come in, by name: the run's, and with compression per link wire.link_codecs."""
        return self.ctx.codecs or {self.codec.name: self.codec}

    def _verify(self, chunk: pb.TensorChunk, payload: bytes, codec) -> float:
        """ChunkError when malformed; else the values' sum of squares (the norm guard's, when it is on; else 0),
        not finite when a value is not."""
        if chunk.name not in self.manifest.shapes and (owner := self.ctx.fragment_of(chunk.name)) is not None:
            raise ChunkError(f"{chunk.name} belongs to fragment {owner}, not to fragment {self.index}")
        return verify_chunk(chunk, self.manifest, codec, payload, sumsq=self.cfg.robust.enabled)

    def receive(self, header: pb.PushHeader, chunks: Iterator[pb.TensorChunk]) -> pb.PushResponse:
        """Spools one push stream; the contribution is complete once every element arrived exactly once.

        A broken stream or a bad chunk discards this stream's spool, so the
        aggregate never sees part of a contribution. A corrupt chunk keeps the
        chunks before it and tells the island how many to skip when it resends.
        """
        self.begin_push(header)
        codec, started, received = self.push_codecs[header.codec], time.monotonic(), 0
        # The island's spools hold at most its share: the spool split over the members (coordinator/spool.py).
        spool: Spool | None = self.ctx.spools.open(self.manifest.total_numel(), header.island_id, len(self.members.islands))
        ranges: list[tuple[str, int, int, float]] = []  # each chunk's address and sum of squares (the norm guard)
        # The guard's direction check needs three contributions (a majority): a run of fewer members pays nothing for it.
        robust = self.cfg.robust
        sketch = self.sketcher.empty() if robust.enabled and robust.direction_check and len(self.members.islands) >= 3 else None
        try:
            for chunk in chunks:
                payload = chunk.payload
                try:
                    sumsq = self._verify(chunk, payload, codec)
                except ChunkCorrupt as e:
                    self._attach(header, spool, ranges, codec, sketch)
                    spool = None  # the contribution owns the chunks kept so far
                    raise Refused(Reason.CORRUPT_CHUNK, f"{e}; resend from chunk {len(ranges)}", resend_from_chunk=len(ranges)) from e
                except ChunkError as e:
                    raise Refused(Reason.BAD_CHUNK, str(e)) from e
                if not math.isfinite(sumsq):
                    self._drop_nonfinite(header, chunk)
                if sketch is not None:  # the guard's direction check (diloco/robust.py), off the close's path
                    self.sketcher.add(sketch, chunk.name, chunk.offset, codec.decode(payload, chunk.numel).numpy())
                spool.write(chunk.name, chunk.offset, chunk.numel, chunk.xxh3, payload)
                ranges.append((chunk.name, chunk.offset, chunk.numel, sumsq))
                size = framed_size(chunk, len(payload))
                received += size
                self._count(header.round, header.island_id, up=size)
            if self.ctx.links is not None:  # what this island's link delivers (compression per link)
                self.ctx.links.observe(header.island_id, received, time.monotonic() - started)
            return self._attach(header, spool, ranges, codec, sketch)
        except BaseException:
            if spool is not None:
                spool.discard()
            raise

    def _drop_nonfinite(self, header: pb.PushHeader, chunk: pb.TensorChunk) -> None:
        with self.cond:
            if self.phase is Phase.OPEN and header.island_id in self.contributions:
                self.drop(header.island_id)
            self.dropped.add(header.island_id)
            self.members.events.dropped_nonfinite += 1
            self.cond.notify_all()
        log.error(
            "%s pushed a pseudo-gradient with NaN/Inf in %s (elements %d..%d); dropped from %sround %d",
            header.island_id, chunk.name, chunk.offset, chunk.offset + chunk.numel, self.label, header.round,
        )
        raise Refused(Reason.NOT_FINITE, f"pseudo-gradient is not finite in {chunk.name}; dropped from {self.label}round {header.round}: "
                      "resync and go on")

    def _attach(self, header: pb.PushHeader, spool: Spool, ranges: list[tuple[str, int, int, float]], codec,
                sketch: np.ndarray | None) -> pb.PushResponse:
        spool.close()
        with self.cond:
            if self.phase is Phase.CLOSING and self.cfg.rounds.late_rounds:
                # The round is being folded (a short while): this push joins the next round, late.
                self.cond.wait_for(lambda: self.phase is not Phase.CLOSING, 600)
            late = self.lateness(header.round, "closed while the push was in flight")
            if not self.members.is_member(header.island_id) or header.island_id in self.dropped:
                raise Refused(Reason.DROPPED, f"{header.island_id} left {self.label}round {header.round} while pushing")
            bucket, key = (self.late, (header.island_id, header.round)) if late else (self.contributions, header.island_id)
            contribution = bucket.get(key)
            if contribution is None:
                contribution = Contribution(header.tokens, header.train_loss, Coverage(self.manifest), samples=ranges_of(header.samples),
                                            lr_sum=lr_sum(header, self.cfg), origin=header.round)
                bucket[key] = contribution
            trial = contribution.coverage.copy()
            for name, offset, numel, _ in ranges:
                trial.add(name, offset, numel)
            if trial.overlaps():
                raise Refused(Reason.DUPLICATE, f"push overlaps data already received: {trial.problem()}")
            contribution.coverage = trial
            contribution.spools.append(spool)
            contribution.codecs.append(codec)
            contribution.sumsq += sum(r[3] for r in ranges)
            if sketch is None:
                contribution.sketched = False
            else:
                contribution.sketch = sketch if contribution.sketch is None else contribution.sketch + sketch
            elements = sum(r[2] for r in ranges)
            response = pb.PushResponse(accepted=True, elements=elements, late=bool(late), folded_into=self.round)
            if trial.problem():  # more streams of this island's contribution are still to come
                return response
            contribution.state, response.contribution_complete = "complete", True
            self.members.pushed(header.island_id)
            log.info("%sround %d: %s contributed %d tokens%s", self.label, header.round, header.island_id, header.tokens,
                     f", {late} round(s) late: folded into round {self.round}" if late else "")
            self.cond.notify_all()
        return response

    def lateness(self, round_: int, what: str) -> int:
        """0 for a push to the open round; s > 0 for one s rounds late that the current round takes (rounds.late_rounds,
        and the coordinator knows what that round started from); else refuses ROUND_CLOSED. Caller holds cond."""
        if round_ == self.round and self.phase is Phase.OPEN:
            return 0
        if round_ > self.round:  # only after a restart from a checkpoint: the island must go back to our round
            raise Refused(Reason.ROUND_AHEAD, f"{self.label}round {round_} is ahead of the coordinator's round {self.round} "
                          "(it restarted from a checkpoint); resync", current_round=self.round)
        late = self.round - round_ + (self.phase is Phase.CLOSING)  # while a round is folded, pushes join the next one
        if self.phase is not Phase.FINISHED and 0 < late <= self.cfg.rounds.late_rounds and round_ in self.published:
            return late
        self.members.events.late_pushes += 1
        beyond = f" and more than rounds.late_rounds={self.cfg.rounds.late_rounds} rounds ago" if self.cfg.rounds.late_rounds else ""
        raise Refused(Reason.ROUND_CLOSED, f"{self.label}round {round_} {what}{beyond} (current round {self.round}); "
                      "fetch the global parameters and train for the current round", current_round=self.round)

    def drop(self, island_id: str) -> None:
        """Forgets an island's contribution to this round. Caller holds cond."""
        contribution = self.contributions.pop(island_id)
        for spool in contribution.spools:
            spool.discard()

    def drop_pending(self, island_id: str) -> None:
        """An island left: its half-pushed contributions go (late ones too). Caller holds cond."""
        contribution = self.contributions.get(island_id)
        if contribution is not None and contribution.state == "pending" and self.phase is Phase.OPEN:
            self.drop(island_id)
        for key in [k for k, c in self.late.items() if k[0] == island_id and c.state == "pending"]:
            for spool in self.late.pop(key).spools:
                spool.discard()

    def _count(self, round_: int, island_id: str, up: int = 0, down: int = 0) -> None:
        with self.cond:
            entry = self.traffic.setdefault((round_, island_id), [0, 0])
            entry[0] += up
            entry[1] += down

    def count_down(self, round_: int, island_id: str, n: int) -> None:
        self._count(round_, island_id, down=n)
