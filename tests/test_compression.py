"""Compressed pseudo-gradients and updates through a live coordinator.

The codec is agreed at join; the lossy downlink keeps every copy of the global
parameters bit-identical; a corrupt chunk is resent; a non-finite
pseudo-gradient drops its island; a checksum mismatch resyncs the island.
"""

from __future__ import annotations

import logging

import grpc
import pytest
import torch

from conftest import claim, island_on, one_island_config, random_like, tiny_config, trained_from, wait_for_round
from diloco.wire.codec import get_codec
from diloco.params import checksum
from islands.sim.simulation import run_sim
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, downlink_codec, tensor_chunks, uplink_codec
from diloco.wire.frames import stub_for
from islands.client import CoordinatorClient, ReplayableChunks
from islands.island import Island
from islands.world import IslandWorld


def _client(coordinator, cfg=None) -> tuple[CoordinatorClient, pb.JoinResponse]:
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10, reconnect_s=10)
    if cfg is not None:
        down = downlink_codec(cfg.wire)
        client.codecs[down.name] = down
    return client, client.join()


def _push(coordinator, client, island_id, round_, pg, codec, chunk_bytes):
    header = pb.PushHeader(island_id=island_id, round=round_, train_loss=1.0, codec=codec.name, **claim(tiny_config()),
                           global_checksum=trained_from(coordinator, round_))
    return client.push(header, ReplayableChunks(tensor_chunks(pg, codec, chunk_bytes)))


@pytest.mark.integration
def test_codec_mismatch_is_refused_at_join(make_coordinator):
    coordinator = make_coordinator(tiny_config("wire.codec='int8'"))
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.join(codec="e3m0")
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "codec mismatch" in err.value.details() and "'int8'" in err.value.details()
        assert client.join(codec="int8").codec == "int8"  # the same codec is welcome
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.parametrize("down", ["int8", "e3m0+zstd", "topk"])
def test_lossy_downlink_keeps_island_and_coordinator_bit_identical(make_coordinator, down):
    cfg = one_island_config("wire.codec='int8'", f"wire.downlink_codec='{down}'", "outer.lr=0.7", "rounds.rounds=5")
    coordinator = make_coordinator(cfg)
    client, joined = _client(coordinator, cfg)
    manifest = Manifest.from_proto(joined.parameters)
    state = coordinator.state
    try:
        theta = {n: torch.zeros(s) for n, s in manifest.shapes.items()}
        held = client.fetch(joined.island_id, theta, manifest).checksum
        theta0 = {n: t.clone() for n, t in theta.items()}
        up = uplink_codec(cfg.wire)
        for round_ in range(5):
            _push(coordinator, client, joined.island_id, round_, random_like(manifest.shapes, seed=round_), up, cfg.wire.chunk_bytes)
            before = client.bytes_received
            header = client.pull(joined.island_id, round_, theta, manifest, held, timeout_s=20)
            held = header.checksum
            assert header.mode == pb.ResultHeader.DELTA and header.codec == down
            # The island's copy is the coordinator's published copy, bit for bit.
            assert checksum(theta) == state.checksum == held
            assert all(torch.equal(theta[n], state.params[n]) for n in theta)
            # The downlink really was compressed.
            assert client.bytes_received - before < 4 * manifest.total_numel() * 0.6
        # The outer optimizer keeps full precision; the gap is the downlink's error feedback, carried forward.
        gap = max(float((state.fragments[0].outer.params[n] - state.params[n]).abs().max()) for n in theta)
        moved = max(float((state.fragments[0].outer.params[n] - theta0[n]).abs().max()) for n in theta)
        assert 0 < gap < (1.0 if down == "topk" else 0.25) * moved, (gap, moved)
    finally:
        client.close()


@pytest.mark.integration
@pytest.mark.parametrize("damage", ["flip-a-bit", "truncate"])
def test_corrupt_chunk_in_transit_is_refused_and_resent(make_coordinator, damage):
    cfg = one_island_config("outer.lr=1.0", "outer.momentum=0.0", "rounds.rounds=1")
    coordinator = make_coordinator(cfg)
    client, joined = _client(coordinator)
    attempts = []

    class DamageThirdChunkOnce(grpc.StreamUnaryClientInterceptor):
        def intercept_stream_unary(self, continuation, details, request_iterator):
            attempts.append(0)

            def messages():
                for i, message in enumerate(request_iterator):
                    if len(attempts) == 1 and i == 3:  # header, then chunks 0, 1, 2 (framed by hand: bytes)
                        damaged = pb.PushMessage.FromString(message)
                        payload = damaged.chunk.payload
                        damaged.chunk.payload = payload[:-4] if damage == "truncate" else bytes([payload[0] ^ 1]) + payload[1:]
                        message = damaged.SerializeToString()
                    yield message

            return continuation(details, messages())

    client.stub = stub_for(grpc.intercept_channel(client.channel, DamageThirdChunkOnce()))
    manifest = Manifest.from_proto(joined.parameters)
    theta0 = {n: t.clone() for n, t in coordinator.state.params.items()}
    pg = random_like(manifest.shapes, seed=4)
    chunks = list(tensor_chunks(pg, get_codec("fp32"), cfg.wire.chunk_bytes))
    try:
        reply = _push(coordinator, client, joined.island_id, 0, pg, get_codec("fp32"), cfg.wire.chunk_bytes)
        assert reply.contribution_complete
        # Refused once with DATA_LOSS, then only the chunks after the kept ones were resent.
        assert len(attempts) == 2
        assert reply.elements == manifest.total_numel() - sum(c.numel for c in chunks[:2])
        wait_for_round(coordinator, 0)
        for n, t in coordinator.state.params.items():
            torch.testing.assert_close(t, theta0[n] - pg[n], rtol=0, atol=1e-6)
    finally:
        client.close()


@pytest.mark.integration
def test_non_finite_pseudo_gradient_drops_its_island_and_never_reaches_the_aggregate(make_coordinator, caplog):
    # One island of the two is dropped for NaN: the other closes round 0 alone (its first outer step: quorum 1).
    cfg = one_island_config("outer.lr=1.0", "outer.momentum=0.0", "rounds.rounds=2", "wire.codec='int8'")
    coordinator = make_coordinator(cfg)
    (bad, bad_joined), (good, good_joined) = _client(coordinator), _client(coordinator)
    manifest = Manifest.from_proto(good_joined.parameters)
    theta0 = {n: t.clone() for n, t in coordinator.state.params.items()}
    codec = uplink_codec(cfg.wire)
    try:
        poisoned = random_like(manifest.shapes, seed=1)
        poisoned["blocks.0.mlp.up_proj.weight"][3, 5] = float("nan")
        with caplog.at_level(logging.ERROR, logger="coordinator.state"):
            with pytest.raises(grpc.RpcError) as err:
                _push(coordinator, bad, bad_joined.island_id, 0, poisoned, codec, cfg.wire.chunk_bytes)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not finite" in err.value.details()
        assert any("NaN/Inf" in r.message and bad_joined.island_id in r.message for r in caplog.records)
        pg = random_like(manifest.shapes, seed=2)
        _push(coordinator, good, good_joined.island_id, 0, pg, codec, cfg.wire.chunk_bytes)
        # The round closes with the good island alone; the dropped one is named in the summary.
        wait_for_round(coordinator, 0)
        summary = coordinator.state.summaries[0]
        assert list(summary.islands) == [good_joined.island_id] and list(summary.dropped) == [bad_joined.island_id]
        decoded = {n: codec.decode(codec.encode(t.reshape(-1)), t.numel()).view(t.shape) for n, t in pg.items()}
        for n, t in coordinator.state.params.items():
            torch.testing.assert_close(t, theta0[n] - decoded[n], rtol=0, atol=1e-6)
    finally:
        bad.close()
        good.close()


@pytest.mark.integration
@pytest.mark.parametrize("uplink", [["wire.codec='int8'"], ["wire.codec='topk'", "wire.feedback_in_model=true"]],
                         ids=["int8", "topk-residual-in-model"])
def test_checksum_mismatch_resyncs_the_island_with_a_warning(make_coordinator, caplog, uplink):
    """Also with the residual kept in the model: the resync starts the island from the fetched global
    parameters, and it still ends holding exactly the coordinator's."""
    cfg = one_island_config("rounds.rounds=4", *uplink, "wire.downlink_codec='int8'")
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    client, joined = _client(coordinator, cfg)
    try:
        island = Island(cfg, world, client, joined)
        sync = island.sync.begin

        def corrupt_in_round_1(f):
            if island.round == 1:  # as if memory or a decoder had gone wrong
                island.global_params["norm.weight"][0] += 0.5
            return sync(f)

        island.sync.begin = corrupt_in_round_1
        with caplog.at_level(logging.WARNING):
            result = island.run()
    finally:
        client.close()
        world.shutdown()
    assert island.ctx.state.resyncs == 1
    assert any("differ from the coordinator's" in r.message for r in caplog.records)
    assert result.rounds == 4 and result.checksum_matches
    assert checksum(island.global_params) == coordinator.state.checksum
    assert checksum(dict(island.ctx.model.named_parameters())) == coordinator.state.checksum


@pytest.mark.integration
def test_sim_with_4bit_uplink_and_compressed_downlink(tmp_path):
    cfg = tiny_config(
        "rounds.rounds=4", "rounds.min_islands=2", "data.shards=2", "inner.steps_per_round=5", "inner.lr=1e-2",
        "inner.warmup_steps=2", "eval.batches=4", "wire.codec='e3m0'", "wire.zstd=true", "wire.downlink_codec='int8'",
    )
    lines: list[str] = []
    report = run_sim(cfg, islands=2, workdir=tmp_path, timeout_s=240, echo=lines.append, per_island=True).report
    assert report["codec"] == "e3m0+zstd" and report["downlink_codec"] == "int8+zstd"
    assert set(report["islands"].values()) == {report["checksum"]} and len(report["islands"]) == 2
    numel = sum(torch.Size(s).numel() for s in _shapes(cfg).values())
    for r in report["rounds"]:
        # Each island pushes 4 bits per element (plus scales), compressed further by zstd; each of this tiny
        # model's chunks also carries its address and 64-bit digest, a larger share than on a real model.
        assert r["bytes_up"] < 2 * 4 * numel / 7.4
        assert set(r["traffic"]) == set(report["islands"])
    assert report["rounds"][-1]["eval_loss"] < report["initial_eval_loss"] - 0.25
    # Where to look (dashboard, island metrics), the header, then one line per round plus one per island per round.
    lines = lines[2:]
    assert len(lines) == 1 + 4 * 3 and lines[1].split()[8].endswith("x")
    # The last round's island lines carry each island's running factor against one DDP rank's traffic.
    for line in lines[-2:]:
        island_id, factor = line.split()[0], line.split()[-1]
        sent = sum(sum(r["traffic"][island_id]) for r in report["rounds"])
        ddp_share = sum(r["ddp_bytes"] / len(r["traffic"]) for r in report["rounds"])
        assert factor == f"{ddp_share / sent:.1f}x" and ddp_share / sent > 4


def _shapes(cfg):
    from coordinator.server import initial_parameters

    return {n: t.shape for n, t in initial_parameters(cfg).items()}


@pytest.mark.integration
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["wire.codec=topk"], True),
        (["wire.codec=topk+zstd"], True),  # was missed once: error feedback silently off
        (["wire.codec=topk", "wire.zstd=true"], True),
        (["wire.codec=int8+zstd"], False),
        (["wire.codec=int8", "wire.error_feedback=true"], True),
        (["wire.codec=topk+zstd", "wire.topk_error_feedback=false"], False),
    ],
)
def test_islands_keep_error_feedback_for_topk_however_it_is_spelled(make_coordinator, overrides, expected):
    cfg = tiny_config("rounds.rounds=1", *overrides)
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    try:
        island = Island(cfg, world, client, client.join(cfg.digest(), uplink_codec(cfg.wire).name))
        assert (island.ctx.feedback is not None) == expected
        if expected:  # feedback_decay's auto default
            assert island.ctx.feedback.decay == (0.25 if "topk" in overrides[0] else 1.0)
    finally:
        client.close()
        world.shutdown()


@pytest.mark.unit
@pytest.mark.parametrize("payload", [0, 100, 20_000, 3_000_000])
def test_framed_size_is_the_wrapping_messages_byte_size(payload):
    from diloco.wire.messages import framed_size

    for chunk in (pb.TensorChunk(name="blocks.0.w", offset=12345, numel=payload // 4, payload=b"\x01" * payload, xxh3=7),
                  pb.TensorChunk(name="", offset=0, numel=2**40, payload=b"\x02" * payload, xxh3=2**64 - 1),
                  pb.TensorChunk(name="é" * 200, offset=-1, numel=1, payload=b"\x03" * payload)):
        expected = framed_size(chunk)
        assert pb.PushMessage(chunk=chunk).ByteSize() == expected
        assert pb.ResultMessage(chunk=chunk).ByteSize() == expected
        assert pb.ResultMessage(mean_chunk=chunk).ByteSize() == expected
        assert framed_size(chunk, len(chunk.payload)) == expected


@pytest.mark.integration
def test_island_keeps_the_topk_residual_in_its_parameters_and_ends_on_the_global_ones(make_coordinator):
    """wire.feedback_in_model: after every landed round but the last, theta_local = theta_global - residual;
    after the last, exactly theta_global; the global copies stay bit-identical throughout."""
    cfg = one_island_config("rounds.rounds=3", "inner.steps_per_round=3", "wire.codec='topk'", "wire.topk_density=0.1",
                      "wire.feedback_in_model=true", "wire.downlink_codec='int8'")
    coordinator = make_coordinator(cfg)
    seen: list[float] = []
    with island_on(coordinator, cfg) as island:
        assert island.ctx.feedback is not None and island.ctx.feedback.in_model
        land = island.sync.land

        def check_after_landing(f):
            land(f)
            local = dict(island.ctx.model.named_parameters())
            gap = max((island.global_params[n] - local[n].detach() - island.ctx.feedback.buffers[n].view(local[n].shape)).abs().max().item()
                      for n in local)
            carried = sum(island.ctx.feedback.buffers[n].abs().sum().item() for n in local)
            if island.ctx.state.rounds_done < 3:
                assert gap < 1e-6 and carried > 0, (island.rounds_done, gap, carried)
            seen.append(carried)

        island.sync.land = check_after_landing
        result = island.run()
    assert len(seen) == 3 and result.rounds == 3 and result.checksum_matches
    assert checksum(island.global_params) == coordinator.state.checksum
    assert checksum(dict(island.ctx.model.named_parameters())) == coordinator.state.checksum


@pytest.mark.integration
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "ranges"])
def test_a_pull_waiting_at_the_close_streams_the_update_while_it_is_made_and_ends_bit_identical(make_coordinator, monkeypatch, sharded):
    """The coordinator steps and publishes a lossy update chunk by chunk, and a waiting pull streams the chunks as
    they are made (the header without a checksum, a trailer after the chunks; with ranges, a
    sharded rank's pull, their checksum in the trailer too). The last parameter's chunks are held back until the
    island has received one chunk: were the pull not streamed, it would wait for the whole update and the
    publication would wait for it, and this test would fail. Every round the island ends holding exactly the
    coordinator's parameters."""
    from diloco.params import ranges_checksum
    from diloco.wire.messages import FlatRange
    import threading

    import islands.client as client_module
    from diloco.wire.frames import ResultRest

    cfg = one_island_config("wire.codec='int8'", "wire.downlink_codec='e3m0'", "outer.lr=0.7", "rounds.rounds=3")
    coordinator = make_coordinator(cfg)
    client, joined = _client(coordinator, cfg)
    manifest = Manifest.from_proto(joined.parameters)
    state, publication = coordinator.state, coordinator.state.fragments[0].publication
    last = list(manifest.shapes)[-1]
    received, trailers = threading.Event(), []
    made = publication._publish_chunk

    def held_back(span, step):
        if span[0] == last and span[1] == 0:
            assert received.wait(30), "the pull received no chunk while the update was being made"
        return made(span, step)

    class Watched(ResultRest):
        def __iter__(self):
            for chunk in super().__iter__():
                received.set()
                yield chunk
            trailers.append(self.trailer)

    monkeypatch.setattr(publication, "_publish_chunk", held_back)
    monkeypatch.setattr(client_module, "ResultRest", Watched)
    # A rank holding the first 3/5 of every parameter (uneven: its ranges end inside chunks).
    ranges = [FlatRange(n, 0, manifest.numel(n) * 3 // 5 or 1) for n in manifest.shapes] if sharded else None
    try:
        theta = {n: torch.zeros(s) for n, s in manifest.shapes.items()}
        held = client.fetch(joined.island_id, theta, manifest).checksum
        if sharded:
            theta = {r.name: theta[r.name].view(-1)[: r.numel].clone() for r in ranges}
        for round_ in range(3):
            received.clear()
            _push(coordinator, client, joined.island_id, round_, random_like(manifest.shapes, seed=round_), uplink_codec(cfg.wire),
                  cfg.wire.chunk_bytes)
            header = client.pull(joined.island_id, round_, theta, manifest, held, timeout_s=20, ranges=ranges)
            assert header.mode == pb.ResultHeader.DELTA and trailers[-1] is not None and trailers[-1].checksum == header.checksum
            held = header.checksum
            assert state.checksum == held
            if sharded:
                assert header.ranges_checksum == trailers[-1].ranges_checksum == ranges_checksum(
                    (r.name, r.offset, state.params[r.name].view(-1)[: r.numel]) for r in ranges)
                assert all(torch.equal(theta[r.name], state.params[r.name].view(-1)[: r.numel]) for r in ranges)
            else:
                assert checksum(theta) == held and all(torch.equal(theta[n], state.params[n]) for n in theta)
        assert header.run_finished  # the last round's trailer says so
    finally:
        client.close()


@pytest.mark.integration
def test_a_result_without_its_checksum_or_with_chunks_after_its_trailer_is_refused_before_anything_is_applied():
    from islands.client import CoordinatorClient, LocalRefusal

    codec = get_codec("int8")
    manifest = Manifest({"w": (64,)})
    chunks = list(tensor_chunks({"w": torch.ones(64)}, codec, 4096))
    header = pb.ResultMessage(header=pb.ResultHeader(round=1, mode=pb.ResultHeader.DELTA, codec="int8", base_checksum="held"))
    trailer = pb.ResultMessage(trailer=pb.ResultTrailer(checksum="c" * 32))
    client = CoordinatorClient.__new__(CoordinatorClient)
    client.codecs, client.bytes_received = {"int8": codec}, 0
    for messages in ([header] + [pb.ResultMessage(chunk=c) for c in chunks],  # no trailer
                     [header, trailer] + [pb.ResultMessage(chunk=c) for c in chunks]):  # chunks after it
        target = {"w": torch.zeros(64)}
        with pytest.raises(LocalRefusal) as err:
            client._receive(iter(messages), target, manifest, "held")
        assert err.value.refusal.reason == pb.Refusal.BAD_CHUNK
        assert torch.equal(target["w"], torch.zeros(64))  # nothing of the delta was added


@pytest.mark.integration
def test_an_island_that_vanishes_mid_stream_leaves_the_update_whole_and_pulls_it_again(make_coordinator, monkeypatch):
    """A pull streaming an update while it is made is cut off after its first chunk (the island's connection drops).
    The publication goes on to the end; the island's next pull gets the whole update and ends on the coordinator's
    parameters, and the following round closes as usual."""
    import threading

    from diloco.v1 import diloco_pb2_grpc as pb_grpc

    cfg = one_island_config("wire.codec='int8'", "wire.downlink_codec='e3m0'", "outer.lr=0.7", "rounds.rounds=2")
    coordinator = make_coordinator(cfg)
    client, joined = _client(coordinator, cfg)
    manifest = Manifest.from_proto(joined.parameters)
    state, publication = coordinator.state, coordinator.state.fragments[0].publication
    last, release = list(manifest.shapes)[-1], threading.Event()
    made = publication._publish_chunk

    def held_back(span, step):
        if span[0] == last and span[1] == 0:
            assert release.wait(30), "the test did not let the publication go on"
        return made(span, step)

    monkeypatch.setattr(publication, "_publish_chunk", held_back)
    try:
        theta = {n: torch.zeros(s) for n, s in manifest.shapes.items()}
        held = client.fetch(joined.island_id, theta, manifest).checksum
        up = uplink_codec(cfg.wire)
        _push(coordinator, client, joined.island_id, 0, random_like(manifest.shapes, seed=0), up, cfg.wire.chunk_bytes)
        call = pb_grpc.CoordinatorStub(client.channel).PullRoundResult(
            pb.PullRequest(island_id=joined.island_id, round=0, timeout_s=20, accept_delta=True), timeout=30)
        first, second = next(call), next(call)
        assert first.header.mode == pb.ResultHeader.DELTA and not first.header.checksum  # streamed: no checksum yet
        assert second.HasField("chunk")
        call.cancel()  # the island is gone half-way through
        release.set()
        wait_for_round(coordinator, 0)
        header = client.pull(joined.island_id, 0, theta, manifest, held, timeout_s=20)
        assert header.checksum == state.checksum and checksum(theta) == header.checksum
        assert all(torch.equal(theta[n], state.params[n]) for n in theta)
        _push(coordinator, client, joined.island_id, 1, random_like(manifest.shapes, seed=1), up, cfg.wire.chunk_bytes)
        header = client.pull(joined.island_id, 1, theta, manifest, header.checksum, timeout_s=20)
        assert header.run_finished and checksum(theta) == state.checksum
    finally:
        release.set()
        client.close()
