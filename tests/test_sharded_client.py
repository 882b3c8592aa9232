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


class LosingShard(FakeShard):
    """A shard that restarted without our contribution: its pull says PUSH_AGAIN until it is pushed again."""

    def __init__(self, name: str, lost: bool = False, waits: int = 0):
        super().__init__(name, waits)
        self.lost, self.pushes = lost, []

    def pull(self, island_id, round_, targets, manifest, held, timeout_s, ranges=None, fragment=0, mean=None):
        if self.lost:
            raise LocalRefusal(Reason.PUSH_AGAIN, f"no contribution from {island_id} in round {round_}; push again")
        return super().pull(island_id, round_, targets, manifest, held, timeout_s, ranges, fragment, mean)

    def push(self, header, chunks):
        self.pushes.append((header.fragment, header.round))
        self.lost = False
        return pb.PushResponse(accepted=True, contribution_complete=True)


class AllChunks:
    names = None

    def only(self, names):
        return self


def test_a_push_again_goes_only_to_the_shards_that_lost_the_contribution():
    """A following shard restarted without our contribution while the leader was closing the round with it: pushed
    to every shard again, the leader refused it (ROUND_CLOSED) and the island resynced the round it was in, in a loop
    of empty pushes (the issue-42 team run). The push again goes to the shard that asked; the next push to all."""
    leader, follower = LosingShard("x", waits=1), LosingShard("y", lost=True)
    client = sharded(leader, follower)
    targets = {n: torch.zeros(s) for n, s in SHAPES.items()}
    with pytest.raises(LocalRefusal) as refused:
        client.pull("island-0", 3, targets, Manifest(SHAPES), "", 10.0)
    assert refused.value.refusal.reason == Reason.PUSH_AGAIN
    header = pb.PushHeader(island_id="island-0", round=3, fragment=0, global_checksum="x+y")
    client.push(header, AllChunks())
    assert leader.pushes == [] and follower.pushes == [(0, 3)]
    assert client.pull("island-0", 3, targets, Manifest(SHAPES), "", 10.0).checksum == "x+y"
    client.push(pb.PushHeader(island_id="island-0", round=4, fragment=0, global_checksum="x+y"), AllChunks())
    assert leader.pushes == [(0, 4)] and follower.pushes == [(0, 3), (0, 4)]
