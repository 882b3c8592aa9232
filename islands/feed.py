"""The batches an island rank trains on: one question, which batch at this inner step, for every source.

- Endless sources (the embedded synthetic language, byte-level text): the
  batch is a pure function of the island's shard, the rank's slot and the
  inner step (diloco.data.sources.StepIndexedStream). Nothing is counted.
- A token corpus: the coordinator leases the island ranges of sample
  positions (coordinator/ledger.py) and the island reads them in order from
  its data cursor (IslandState). A committed inner step reads the next
  participants x world x batch samples: the participating group of rank p
  takes slot p, its rank r the batch at slot p * world + r; a step that does
  not commit reads the same samples again. A push names the positions read
  since the fragment's last sync, so the coordinator can fold every sample at
  most once; a healing group receives the cursor and the leases with the
  rest of the island's position.
"""

from __future__ import annotations

import logging

import torch

from diloco.data.sources import Batch, StepIndexedStream, open_corpus
from diloco.data.samples import WindowSamples
from islands.joining import JoinRefused
from islands.state import IslandState

log = logging.getLogger(__name__)


class StepFeed:
    """Endless sources: the batch of inner step s for this rank's slot."""

    leased = False

    def __init__(self, stream: StepIndexedStream, batch_size: int):
        self.stream, self.batch_size = stream, batch_size

    def batch(self, state: IslandState, participating_rank: int, participants: int) -> Batch:
        return self.stream.batch_at(state.step, self.batch_size)

    def samples_per_step(self, participants: int) -> int:
        return 0


class CorpusFeed:
    """A token corpus read through the island's leases."""

    leased = True

    def __init__(self, samples: WindowSamples, client, island_id, batch_size: int, world_size: int, rank: int,
                 groups: int, steps_per_round: int):
        self.samples, self.client, self.island_id = samples, client, island_id
        self.batch_size, self.world_size, self.rank, self.groups = batch_size, world_size, rank, groups
        self.lease_size = steps_per_round * groups * world_size * batch_size  # a round's samples at full strength

    def samples_per_step(self, participants: int) -> int:
        return participants * self.world_size * self.batch_size

    def _cover(self, state: IslandState, need: int) -> None:
        """Leases until the held pieces reach virtual position `need`."""
        for _ in range(10_000):  # bounded: each lease is at least one sample, or an old one fully used
            if state.data_end >= need:
                return
            reply = self.client.lease(self.island_id(), state.leases_taken, self.lease_size)
            ranges = [(r.start, r.stop) for r in reply.ranges]
            state.add_lease(ranges)
            for a, b in ranges:
                self.samples.prefetch(a, b - a)
            log.debug("%s: lease %d: %s", self.island_id(), reply.index, ranges)
        raise RuntimeError(f"{self.island_id()}: no new samples after 10000 leases; is the coordinator's ledger sane?")

    def batch(self, state: IslandState, participating_rank: int, participants: int) -> Batch:
        b = self.batch_size
        # Every rank covers the whole step at full strength: all ask for the same lease numbers.
        self._cover(state, state.data_cursor + self.groups * self.world_size * b)
        slot = participating_rank if 0 <= participating_rank < participants else participants
        slot = min(slot * self.world_size + self.rank, self.groups * self.world_size - 1)
        lo = state.data_cursor + slot * b
        seqs = torch.cat([self.samples.sequences(a, n - a) for a, n in state.positions(lo, lo + b)])
        return seqs[:, :-1], seqs[:, 1:]


def make_feed(cfg, joined, world, spec, client, island_id) -> StepFeed | CorpusFeed:
    """The feed of this rank: its slot's endless stream, or the run's token corpus read through leases."""
    if cfg.data.source != "tokens":
        slots = spec.groups * world.world_size
        slot = spec.group * world.world_size + world.rank
        stream = StepIndexedStream(cfg.data, cfg.seed, joined.shard_index * slots + slot, cfg.data.shards * slots)
        return StepFeed(stream, cfg.inner.batch_size)
    corpus = open_corpus(cfg.data, cfg.seed, cfg.model.vocab_size)
    if (corpus.digest, corpus.samples.epoch_size) != (joined.data_digest, joined.data_epoch_size):
        raise JoinRefused(
            f"the corpus at {cfg.data.url} is not the coordinator's (digest {corpus.digest[:12]}, "
            f"{corpus.samples.epoch_size} samples an epoch; the coordinator's: {joined.data_digest[:12]}, "
            f"{joined.data_epoch_size}): point data.url at the same dataset")
    return CorpusFeed(corpus.samples, client, island_id, cfg.inner.batch_size, world.world_size, world.rank,
                      spec.groups, cfg.inner.steps_per_round)
