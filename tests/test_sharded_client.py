"""An island's client for a sharded coordinator (islands/sharded.py), against fake shards: how calls split and join."""

from __future__ import annotations

import pytest
import torch

from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest
from diloco.wire.refusal import Reason
from islands.client import LocalRefusal
from islands.sharded import ShardedClient

pytestmark = pytest.mark.unit

SHAPES = {"a": (4,), "b": (4,), "c": (4,), "d": (4,)}


class FakeShard:
    """Answers pulls with a header of its own checksum; refuses STILL_OPEN the first `waits` times."""

    def __init__(self, name: str, waits: int = 0):
        self.name, self.waits, self.pulls, self.codecs, self.on_call, self.progress = name, waits, [], {}, None, False

    def pull(self, island_id, round_, targets, manifest, held, timeout_s, ranges=None, fragment=0, mean=None):
        self.pulls.append(sorted(manifest.shapes))
        if self.waits:
            self.waits -= 1
            raise LocalRefusal(Reason.STILL_OPEN, "the round is still open")
        return pb.ResultHeader(round=round_ + 1, checksum=self.name, fragments=[pb.FragmentState(index=0, round=round_ + 1, checksum=self.name)])


def sharded(*shards: FakeShard) -> ShardedClient:
    spare = list(shards[1:])
    client = ShardedClient(shards[0], lambda address: spare.pop(0))
    client.adopt(pb.JoinResponse(parameters=Manifest(SHAPES).to_proto(), shard_addresses=[f"s{i}:1" for i in range(len(shards))],
                                 fragments=[pb.FragmentSpec(index=0, names=list(SHAPES))]))
    return client


def test_a_pull_splits_by_the_map_and_joins_the_shards_checksums_in_order():
    first, second = FakeShard("x"), FakeShard("y")
    client = sharded(first, second)
    targets = {n: torch.zeros(s) for n, s in SHAPES.items()}
    header = client.pull("island-0", 3, targets, Manifest(SHAPES), "", 10.0)
    assert (header.round, header.checksum, header.fragments[0].checksum) == (4, "x+y", "x+y")
    assert first.pulls == [["a", "b"]] and second.pulls == [["c", "d"]]


def test_a_pull_cut_short_by_one_shards_wait_does_not_ask_the_others_again():
    """A shard that delivered (perhaps a delta, which adds) is not pulled twice for one round."""
    first, second = FakeShard("x"), FakeShard("y", waits=2)
    client = sharded(first, second)
    targets = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for _ in range(2):
        with pytest.raises(LocalRefusal) as waited:
            client.pull("island-0", 3, targets, Manifest(SHAPES), "", 10.0)
        assert waited.value.refusal.reason == Reason.STILL_OPEN
    header = client.pull("island-0", 3, targets, Manifest(SHAPES), "", 10.0)
    assert header.checksum == "x+y" and len(first.pulls) == 1 and len(second.pulls) == 3
    client.pull("island-0", 4, targets, Manifest(SHAPES), "", 10.0)  # the next round asks every shard again
    assert len(first.pulls) == 2
