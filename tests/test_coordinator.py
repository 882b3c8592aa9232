"""The coordinator refuses bad pushes and never lets part of a contribution into the aggregate."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import claim, ended, join, random_like, tiny_config, trained_from, wait_for_round
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of, refusal_of
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, make_chunk, tensor_chunks


def _header(coordinator, island_id, round_=0):
    return pb.PushMessage(header=pb.PushHeader(island_id=island_id, round=round_, train_loss=1.0, codec="fp32",
                                               **claim(tiny_config()), global_checksum=trained_from(coordinator, round_)))


def _chunk(name, offset, values: torch.Tensor):
    payload = Fp32Codec().encode(values)
    return pb.PushMessage(chunk=make_chunk(name, offset, values.numel(), payload))


def _messages(coordinator, island_id, pg, chunk_bytes, round_=0):
    yield _header(coordinator, island_id, round_)
    for c in tensor_chunks(pg, Fp32Codec(), chunk_bytes):
        yield pb.PushMessage(chunk=c)


def _expected_after_one_round(theta, pgs_tokens, lr):
    total = sum(t for _, t in pgs_tokens)
    return {n: theta[n] - lr * sum(t * pg[n] for pg, t in pgs_tokens) / total for n in theta}


@pytest.fixture
def run(make_coordinator, channel_to):
    # These islands never heartbeat: a lease that outlasts any test on a busy machine.
    cfg = tiny_config("outer.lr=1.0", "outer.momentum=0.0", "rounds.rounds=2", "rounds.min_islands=2", "rounds.lease_s=600")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = join(stub), join(stub)
    manifest = Manifest.from_proto(a.parameters)
    theta0 = {n: t.clone() for n, t in coordinator.state.params.items()}
    return cfg, coordinator, stub, a.island_id, b.island_id, manifest, theta0


def _finish_round_and_check(cfg, coordinator, stub, ids, manifest, theta0):
    pgs = [random_like(manifest.shapes, seed=i) for i in range(2)]
    for island_id, pg in zip(ids, pgs):
        reply = stub.PushPseudoGradient(ended(_messages(coordinator, island_id, pg, cfg.wire.chunk_bytes)), timeout=10)
        assert reply.contribution_complete
    wait_for_round(coordinator, 0)
    tokens = claim(cfg)["tokens"]  # both islands claim one inner step: equal weights
    expected = _expected_after_one_round(theta0, [(pgs[0], tokens), (pgs[1], tokens)], lr=1.0)
    for n, t in coordinator.state.params.items():
        torch.testing.assert_close(t, expected[n], rtol=1e-6, atol=1e-7)


@pytest.mark.integration
@pytest.mark.parametrize(
    "bad_chunk, expect",
    [
        (lambda m: _chunk("no.such.param", 0, torch.ones(4)), "unknown parameter name 'no.such.param'"),
        # A pseudo-gradient of the wrong shape: more elements than the parameter has.
        (lambda m: _chunk("blocks.0.mlp.up_proj.weight", 0, torch.ones(m.numel("blocks.0.mlp.up_proj.weight") + 8)), "run past the end"),
        (lambda m: _chunk("norm.weight", 30, torch.ones(4)), "elements [30, 34) run past the end of the tensor (32 elements"),
        (lambda m: _chunk("norm.weight", -1, torch.ones(4)), "bad range"),
    ],
    ids=["unknown-name", "wrong-shape", "offset-past-end", "negative-offset"],
)
def test_bad_chunk_is_invalid_argument_and_aggregate_unaffected(run, bad_chunk, expect):
    cfg, coordinator, stub, a, b, manifest, theta0 = run

    def messages():
        yield from list(_messages(coordinator, a, random_like(manifest.shapes, seed=99), cfg.wire.chunk_bytes))[:3]
        yield bad_chunk(manifest)

    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(messages(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(err.value) == Reason.BAD_CHUNK
    assert expect in err.value.details()
    assert not coordinator.state.fragments[0].contributions
    assert not list(coordinator.state.spool_dir.iterdir()), "a refused push left spool files behind"
    _finish_round_and_check(cfg, coordinator, stub, [a, b], manifest, theta0)


@pytest.mark.integration
def test_payload_that_does_not_match_numel_is_refused(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    payload = Fp32Codec().encode(torch.ones(3))
    lying = pb.PushMessage(chunk=make_chunk("norm.weight", 0, 4, payload))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(iter([_header(coordinator, a), lying]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "payload is 12 bytes" in err.value.details()
    assert reason_of(err.value) == Reason.BAD_CHUNK


@pytest.mark.integration
def test_corrupt_chunk_is_data_loss(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    good = _chunk("norm.weight", 0, torch.ones(32))
    good.chunk.xxh3 ^= 1
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(iter([_header(coordinator, a), _chunk("blocks.0.attn_norm.weight", 0, torch.ones(32)), good]), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    refusal = refusal_of(err.value)
    assert refusal.reason == Reason.CORRUPT_CHUNK and refusal.resend_from_chunk == 1


@pytest.mark.integration
def test_disconnect_mid_push_leaves_no_partial_contribution(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    messages = list(_messages(coordinator, a, random_like(manifest.shapes, seed=7, scale=100.0), cfg.wire.chunk_bytes))
    assert len(messages) > 6
    hang = threading.Event()

    def half_then_hang():
        yield from messages[: len(messages) // 2]
        hang.wait(10)

    call = stub.PushPseudoGradient.future(half_then_hang())
    deadline = time.monotonic() + 120
    received = lambda: coordinator.state.fragments[0].traffic.get((0, a), [0, 0])[0]  # noqa: E731
    while received() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received() > 0, "the server never saw the first half"
    call.cancel()  # the island goes away mid-stream
    hang.set()
    started = time.monotonic()
    while list(coordinator.state.spool_dir.iterdir()) and time.monotonic() < started + 120:  # an event, not a margin
        time.sleep(0.01)
    assert not list(coordinator.state.spool_dir.iterdir()), "the broken push left a spool behind"
    print(f"spool discarded {time.monotonic() - started:.2f}s after the cancel")
    assert a not in coordinator.state.fragments[0].contributions
    # Both islands now push in full; the huge half-pushed values must not show up.
    _finish_round_and_check(cfg, coordinator, stub, [a, b], manifest, theta0)


@pytest.mark.integration
@pytest.mark.parametrize("end", [None, 1], ids=["no-push-end", "push-end-miscounts"])
def test_stream_that_ends_without_its_push_end_keeps_nothing(run, end):
    """A cancelled call can reach the server as a clean end of its stream (gRPC races the two):
    only a PushEnd that counts the stream's chunks makes them part of a contribution."""
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    messages = list(_messages(coordinator, a, random_like(manifest.shapes, seed=7, scale=100.0), cfg.wire.chunk_bytes))
    cut = messages[: len(messages) // 2] + ([pb.PushMessage(end=pb.PushEnd(chunks=end))] if end is not None else [])
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(iter(cut), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason_of(err.value) == Reason.BAD_REQUEST
    assert ("without its PushEnd" if end is None else "PushEnd counts 1 chunks") in err.value.details()
    assert a not in coordinator.state.fragments[0].contributions
    assert not list(coordinator.state.spool_dir.iterdir()), "the cut-off stream left a spool behind"
    # The island pushes again in full (as its retry would), and the round is exactly the two full pushes.
    _finish_round_and_check(cfg, coordinator, stub, [a, b], manifest, theta0)


@pytest.mark.integration
def test_push_that_ends_early_is_not_aggregated(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    messages = list(_messages(coordinator, a, random_like(manifest.shapes, seed=5, scale=100.0), cfg.wire.chunk_bytes))
    reply = stub.PushPseudoGradient(ended(messages[:-1]), timeout=10)
    assert reply.accepted and not reply.contribution_complete
    assert coordinator.state.fragments[0].contributions[a].state == "pending"
    # The rest arrives in a second stream (as from another rank): only then is it whole.
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(ended([messages[0], messages[1]]), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and reason_of(err.value) == Reason.DUPLICATE
    assert "more than once" in err.value.details()
    reply = stub.PushPseudoGradient(ended([messages[0], messages[-1]]), timeout=10)
    assert reply.contribution_complete
    assert coordinator.state.fragments[0].contributions[a].state == "complete"


@pytest.mark.integration
def test_push_for_a_closed_round_is_failed_precondition(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    _finish_round_and_check(cfg, coordinator, stub, [a, b], manifest, theta0)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(ended(_messages(coordinator, a, random_like(manifest.shapes, seed=1), cfg.wire.chunk_bytes, round_=0)), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "round 0 is closed" in err.value.details()
    refusal = refusal_of(err.value)
    assert refusal.reason == Reason.ROUND_CLOSED and refusal.current_round == 1


@pytest.mark.integration
def test_second_contribution_in_a_round_is_already_exists(run):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    pg = random_like(manifest.shapes, seed=1)
    stub.PushPseudoGradient(ended(_messages(coordinator, a, pg, cfg.wire.chunk_bytes)), timeout=10)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(ended(_messages(coordinator, a, pg, cfg.wire.chunk_bytes)), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS and reason_of(err.value) == Reason.DUPLICATE


@pytest.mark.integration
def test_unknown_island_and_config_mismatch_are_refused(run, channel_to):
    cfg, coordinator, stub, a, b, manifest, theta0 = run
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(island_id="island-404"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and reason_of(err.value) == Reason.NOT_A_MEMBER
    with pytest.raises(grpc.RpcError) as err:
        join(stub, digest="0000")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "config mismatch" in err.value.details()
    assert reason_of(err.value) == Reason.CONFIG_MISMATCH


@pytest.mark.integration
def test_health_service_reports_serving(run, channel_to):
    cfg, coordinator, stub, *_ = run
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="diloco.v1.Coordinator"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()


@pytest.mark.unit
def test_chunks_stay_under_grpc_default_limit_for_large_tensors():
    big = {"w": torch.zeros(8_000_000)}  # 32 MB of fp32
    sizes = [pb.PushMessage(chunk=c).ByteSize() for c in tensor_chunks(big, Fp32Codec(), 1 << 20)]
    assert len(sizes) == 31 and max(sizes) < 4 * 1024 * 1024
