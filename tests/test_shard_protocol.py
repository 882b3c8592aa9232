"""Per-shard exchange: ranges on fetch and pull, a delta per shard, range checksums, join by island key."""

from __future__ import annotations


import grpc
import pytest
import torch

from conftest import claim, one_island_config, random_like, tiny_config, wait_for_round
from diloco.wire.codec import Fp32Codec
from diloco.params import ranges_checksum
from diloco.wire.refusal import Reason, reason_of
from diloco.wire.messages import FlatRange, Manifest, downlink_codec, encode_chunks
from islands.client import CoordinatorClient, RegeneratingChunks
from diloco.v1 import diloco_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _halves(manifest: Manifest) -> list[list[FlatRange]]:
    """Two 'ranks', each holding a contiguous flat range of every parameter (uneven on purpose)."""
    first, second = [], []
    for name in manifest.shapes:
        n = manifest.numel(name)
        cut = (n * 3) // 5
        first.append(FlatRange(name, 0, cut))
        second.append(FlatRange(name, cut, n - cut))
    return [first, second]


def _shards(ranges: list[FlatRange]) -> dict[str, torch.Tensor]:
    return {r.name: torch.full((r.numel,), float("nan")) for r in ranges}


@pytest.fixture
def clients(make_coordinator):
    made = []

    def make(coordinator, n: int = 2):
        for _ in range(n):
            made.append(CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10, reconnect_s=5))
        return made[-n:]

    yield make
    for c in made:
        c.close()


def test_fetch_of_ranges_gives_exactly_those_elements_and_their_checksum(make_coordinator, clients):
    coordinator = make_coordinator(tiny_config())
    a, b = clients(coordinator)
    joined = a.join()
    manifest = Manifest.from_proto(joined.parameters)
    parts = _halves(manifest)
    for client, ranges in zip((a, b), parts):
        shards = _shards(ranges)
        header = client.fetch(joined.island_id, shards, manifest, ranges)
        assert header.checksum == coordinator.state.checksum and header.ranges_checksum
        for r in ranges:
            assert torch.equal(shards[r.name], coordinator.state.params[r.name].view(-1)[r.offset : r.end])
    # A range outside the tensor is refused with a message naming it.
    with pytest.raises(grpc.RpcError) as err:
        a.fetch(joined.island_id, {"norm.weight": torch.zeros(8)}, manifest, [FlatRange("norm.weight", 30, 8)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the tensor" in err.value.details()


def _push_shard(client, island_id, round_, ranges, pg, chunk_bytes, checksum):
    header = pb.PushHeader(island_id=island_id, round=round_, train_loss=1.0, codec="fp32", global_checksum=checksum,
                           **claim(tiny_config()))

    def chunks(start: int, keep=None):
        produced = (c for r in ranges if keep is None or r.name in keep for c in encode_chunks(r.name, pg[r.name].view(-1)[r.offset : r.end], Fp32Codec(), chunk_bytes, r.offset))
        for i, c in enumerate(produced):
            if i >= start:
                yield c

    return client.push(header, RegeneratingChunks(chunks))


@pytest.mark.parametrize("downlink", ["fp32", "int8"])
def test_two_ranks_push_and_pull_their_shards_and_stay_bit_identical(make_coordinator, clients, downlink, caplog):
    cfg = one_island_config("rounds.rounds=3", f"wire.downlink_codec='{downlink}'", "wire.chunk_bytes=1024")
    coordinator = make_coordinator(cfg)
    a, b = clients(coordinator)
    for c in (a, b):
        c.codecs[downlink] = downlink_codec(cfg.wire)
    joined = a.join(island_key="k")
    assert b.join(island_key="k").island_id == joined.island_id, "the second group of the island got another island"
    manifest = Manifest.from_proto(joined.parameters)
    parts = _halves(manifest)
    shards = [_shards(r) for r in parts]
    held = [c.fetch(joined.island_id, s, manifest, r).checksum for c, s, r in zip((a, b), shards, parts)]
    for round_ in range(2):
        pg = random_like(manifest.shapes, seed=round_)
        replies = [_push_shard(c, joined.island_id, round_, r, pg, cfg.wire.chunk_bytes, h) for c, r, h in zip((a, b), parts, held)]
        assert [x.contribution_complete for x in replies] == [False, True]
        wait_for_round(coordinator, round_)
        headers = [
            c.pull(joined.island_id, round_, s, manifest, h, timeout_s=10, ranges=r)
            for c, s, r, h in zip((a, b), shards, parts, held)
        ]
        # From round 1 on a lossy downlink sends deltas, applied per shard.
        expect_delta = downlink != "fp32"
        assert all((h.mode == pb.ResultHeader.DELTA) == expect_delta for h in headers), [h.mode for h in headers]
        held = [h.checksum for h in headers]
        assembled = {n: torch.cat([shards[0][n], shards[1][n]]).view(manifest.shapes[n]) for n in manifest.shapes}
        for n, t in coordinator.state.params.items():
            assert torch.equal(assembled[n], t), n
    if downlink == "fp32":
        return  # values overwrite whatever the shard held; only a delta can meet a drifted shard
    # A shard that drifted from the coordinator's no longer verifies: CHECKSUM_MISMATCH at once (not
    # retried, the delta must not be added twice), which makes the island resync with a fetch.
    pg = random_like(manifest.shapes, seed=7)
    for c, r, h in zip((a, b), parts, held):
        _push_shard(c, joined.island_id, 2, r, pg, cfg.wire.chunk_bytes, h)
    shards[1]["norm.weight"][0] += 1.0
    with pytest.raises(grpc.RpcError) as err:
        b.pull(joined.island_id, 2, shards[1], manifest, held[1], timeout_s=10, ranges=parts[1])
    assert reason_of(err.value) == Reason.CHECKSUM_MISMATCH and "ranges checksum" in err.value.details()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], "a checksum mismatch was retried"
    header = b.fetch(joined.island_id, shards[1], manifest, parts[1])
    assert header.ranges_checksum == ranges_checksum((r.name, r.offset, shards[1][r.name]) for r in parts[1])


def test_island_key_joins_one_island_until_it_leaves(make_coordinator, clients):
    coordinator = make_coordinator(tiny_config())
    (a,) = clients(coordinator, 1)
    first = a.join(island_key="dc-1").island_id
    assert a.join(island_key="dc-1").island_id == first
    assert a.join(island_key="dc-2").island_id != first
    assert a.join().island_id not in (first,)
    a.leave(first, "", 0)
    assert a.join(island_key="dc-1").island_id != first, "a key must not bring back an island that left"
