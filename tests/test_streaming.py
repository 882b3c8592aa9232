"""Streaming DiLoCo end to end: the exact arithmetic, fragment independence, real overlap, eager updates.

The reference below writes Streaming DiLoCo out in one process, from the
algorithm's statement, with none of the machinery under test (no fragment
layout module, no schedule code, no mixing helper, no gRPC): only the model,
the data, the inner step and the outer optimizer. Islands and coordinator must
reproduce it bit for bit.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from conftest import claim, ended, island_on, kill_all_and_resume, random_like, tiny_config, trained_from
from diloco.wire.codec import Fp32Codec
from diloco.config import RunConfig
from diloco.data.sources import StepIndexedStream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.models.llama import Transformer
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.params import checksum, fp32_copy
from islands.sim.simulation import RoundPrinter, Simulation
from diloco.streaming import OuterReplica, eager_gradient, mix_, swap_estimate_
from diloco.v1 import diloco_pb2 as pb
from islands.sim.wan import WanLink
from diloco.wire.messages import PROTOCOL_VERSION, tensor_chunks
from islands.client import CoordinatorClient
from islands.island import Island
from islands.launch import run_island
from islands.state import ReplicaSpec
from islands.world import IslandWorld

pytestmark = pytest.mark.timeout(120)


def _cfg(*overrides: str) -> RunConfig:
    return tiny_config(
        "model.n_layers=2", "rounds.rounds=3", "inner.steps_per_round=4", "rounds.min_islands=2", "data.shards=2",
        "inner.warmup_steps=2", "inner.lr=1e-2", *overrides,
    )


def reference(cfg: RunConfig, islands: int) -> dict[str, torch.Tensor]:
    """Streaming DiLoCo in one process: fp32 both ways, every island in every round."""
    s, h, rounds = cfg.streaming, cfg.inner.steps_per_round, cfg.rounds.rounds
    p, total = s.fragments, rounds * cfg.inner.steps_per_round
    tau = s.tau if s.tau >= 0 else (1 if p > 1 else 0)
    torch.manual_seed(cfg.seed)
    outer_params = fp32_copy(Transformer(cfg.model))
    names = list(outer_params)

    def owner(name: str) -> int:  # strided blocks; embedding with block 0, the rest with the last block
        block = int(name.split(".")[1]) if name.startswith("blocks.") else (0 if name == "embed.weight" else cfg.model.n_layers - 1)
        return block % p

    frag = [[n for n in names if owner(n) == f] for f in range(p)]
    outer = [OuterOptimizer({n: outer_params[n] for n in frag[f]}, cfg.outer) for f in range(p)]
    held = {n: t.clone() for n, t in outer_params.items()}  # theta_global as the islands hold it
    models = []
    for _ in range(islands):
        m = Transformer(cfg.model)
        with torch.no_grad():
            for n, q in m.named_parameters():
                q.copy_(held[n])
        models.append(m)
    optimizers = [build_inner_optimizer(m, cfg.inner) for m in models]
    streams = [StepIndexedStream(cfg.data, cfg.seed, i, cfg.data.shards) for i in range(islands)]
    local = [dict(m.named_parameters()) for m in models]
    done = [0] * p
    landing: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    def land(f: int) -> None:
        _, new = landing.pop(f)
        a = 0.0 if done[f] == rounds else s.alpha
        with torch.no_grad():
            for n in frag[f]:
                held[n].copy_(new[n])
                for lp in local:
                    lp[n].mul_(a).add_(new[n], alpha=1 - a) if a else lp[n].copy_(new[n])

    for c in range(total + 1):
        for f in sorted(landing):
            if landing[f][0] <= c:
                land(f)
        for f in range(p):
            end = total if done[f] == rounds - 1 else (done[f] + 1) * h - f * h // p
            if done[f] < rounds and c == end:
                acc = PseudoGradientAccumulator({n: outer_params[n].shape for n in frag[f]})
                for lp in local:
                    acc.add(1, {n: held[n] - lp[n].detach() for n in frag[f]})
                outer[f].step(acc.mean())
                done[f] += 1
                landing[f] = (c + tau if c < total else c, {n: outer_params[n].clone() for n in frag[f]})
                if landing[f][0] <= c:
                    land(f)
        if c == total:
            break
        for model, optimizer, stream in zip(models, optimizers, streams):
            lr = inner_lr(c, total, cfg.inner)
            train_step(model, optimizer, stream.batch_at(c, cfg.inner.batch_size), lr, cfg.inner.grad_clip)
    return outer_params


def _run_islands(coordinator, cfg: RunConfig, n: int = 2):
    """n one-rank islands, each on a thread of this process, against the coordinator."""
    world = IslandWorld.init("cpu")
    results, errors = [], []

    def one() -> None:
        try:
            results.append(run_island(f"127.0.0.1:{coordinator.port}", cfg, world, ReplicaSpec(), connect_timeout_s=10))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        world.shutdown()
    assert not errors, errors
    assert len(results) == n, "an island did not finish in time"
    return results


@pytest.mark.integration
@pytest.mark.parametrize(
    "overrides",
    [
        ("streaming.fragments=1", "streaming.tau=0", "streaming.alpha=0.0"),  # plain DiLoCo
        ("streaming.fragments=2", "streaming.tau=1", "streaming.alpha=0.5"),
        ("streaming.fragments=2", "streaming.tau=3", "streaming.alpha=0.0", "rounds.rounds=2"),
    ],
    ids=["P1-tau0-plain", "P2-tau1-alpha0.5", "P2-tau3"],
)
def test_islands_and_coordinator_reproduce_the_reference_bit_for_bit(make_coordinator, overrides):
    cfg = _cfg(*overrides)
    coordinator = make_coordinator(cfg)
    results = _run_islands(coordinator, cfg)
    expected = reference(cfg, 2)
    state = coordinator.state
    assert [f.round for f in state.fragments] == [cfg.rounds.rounds] * cfg.streaming.fragments
    for name, value in expected.items():
        assert torch.equal(state.params[name], value), f"{name} differs from the reference"
    assert all(r.checksum_matches for r in results)
    assert {r.inner_steps for r in results} == {cfg.rounds.rounds * cfg.inner.steps_per_round}


@pytest.mark.integration
def test_a_fragment_closes_its_rounds_while_another_fragment_waits(make_coordinator, channel_to):
    cfg = _cfg("streaming.fragments=2", "rounds.deadline_s=60", "rounds.lease_s=60")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b = (stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5) for _ in range(2))
    assert [list(f.names) for f in a.fragments] == [list(f.names) for f in coordinator.state.layout]
    state = coordinator.state
    shapes = [state.fragments[f].manifest.shapes for f in range(2)]

    def push(island, fragment, round_, seed):
        header = pb.PushHeader(island_id=island, round=round_, codec="fp32", fragment=fragment, **claim(cfg),
                               global_checksum=trained_from(coordinator, round_, fragment))
        chunks = tensor_chunks(random_like(shapes[fragment], seed), Fp32Codec(), cfg.wire.chunk_bytes)
        return stub.PushPseudoGradient(ended([pb.PushMessage(header=header)] + [pb.PushMessage(chunk=c) for c in chunks]), timeout=10)

    # Island b holds back its push for fragment 1; fragment 0 goes through two rounds regardless.
    push(a.island_id, 1, 0, seed=1)
    for round_ in range(2):
        push(a.island_id, 0, round_, seed=10 + round_)
        push(b.island_id, 0, round_, seed=20 + round_)
        with state.cond:
            closed = lambda: state.fragments[0].round > round_ and len(state.summaries) > round_  # noqa: E731
            assert state.cond.wait_for(closed, 10), "fragment 0 did not close"
    assert state.fragments[1].round == 0 and state.fragments[1].phase.value == "open"
    assert [s.fragment for s in state.summaries] == [0, 0]
    # A chunk of fragment 1's parameters in a push for fragment 0 is refused, naming the fragment.
    wrong = next(n for n in shapes[1])
    header = pb.PushHeader(island_id=a.island_id, round=2, codec="fp32", fragment=0, **claim(cfg),
                           global_checksum=trained_from(coordinator, 2, 0))
    chunk = next(tensor_chunks({wrong: torch.zeros(shapes[1][wrong])}, Fp32Codec(), cfg.wire.chunk_bytes))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushPseudoGradient(iter([pb.PushMessage(header=header), pb.PushMessage(chunk=chunk)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "belongs to fragment 1" in err.value.details()
    push(b.island_id, 1, 0, seed=2)
    with state.cond:
        assert state.cond.wait_for(lambda: state.fragments[1].round == 1, 10), "fragment 1 did not close"


@pytest.mark.integration
def test_overlap_keeps_training_while_a_slowed_exchange_is_in_flight(make_coordinator):
    cfg = _cfg("streaming.fragments=2", "streaming.tau=1", "rounds.min_islands=1", "robust.first_quorum=1", "data.shards=1", "rounds.rounds=3")
    coordinator = make_coordinator(cfg)
    link = WanLink(("127.0.0.1", coordinator.port), "20mbit:60ms").start()  # every exchange takes >= 4 x 60 ms
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(link.address, connect_timeout_s=10)
    try:
        island = Island(cfg, world, client, client.join(cfg.digest()))
        island.step_spans = []
        result = island.run()
    finally:
        client.close()
        world.shutdown()
        link.stop()
    assert result.checksum_matches and result.inner_steps == 12
    overlapped = [e for e in island.ctx.exchanges if e["due"] > e["pushed_step"]]
    assert len(overlapped) == 4  # all but the last wave, which ends the run
    for e in overlapped:
        t0, _ = island.step_spans[e["pushed_step"]]  # the inner step right after the push
        assert e["started_at"] <= t0 < e["finished_at"], f"step {e['pushed_step']} did not start during the exchange"
        assert e["finished_at"] - e["started_at"] >= 0.24
    # Waiting is what the exchanges did not hide; it is not counted as compute.
    spent = sum(e["finished_at"] - e["started_at"] for e in island.ctx.exchanges)
    assert result.wait_s < spent and result.compute_s + result.wait_s <= result.wall_s


@pytest.mark.unit
def test_mixing_arithmetic():
    local = {"w": torch.tensor([1.0, 2.0, -4.0])}
    global_ = {"w": torch.tensor([3.0, 2.0, 0.0])}
    mix_(local, global_, 0.25)
    assert torch.equal(local["w"], torch.tensor([0.25 * 1 + 0.75 * 3, 2.0, -1.0]))
    mix_(local, global_, 0.0)
    assert torch.equal(local["w"], global_["w"])
    # Swapping an estimate for the exact result keeps the local progress made meanwhile.
    estimate, exact = {"w": torch.tensor([1.0, 1.0, 1.0])}, {"w": torch.tensor([2.0, 0.0, 1.0])}
    local = {"w": torch.tensor([1.5, 0.5, 1.0])}  # the estimate plus 0.5, -0.5, 0 of local steps
    swap_estimate_(local, exact, estimate, 0.0)
    assert torch.equal(local["w"], torch.tensor([2.5, -0.5, 1.0]))


@pytest.mark.unit
def test_eager_outer_replica_matches_the_coordinators_optimizer_bit_for_bit():
    cfg = tiny_config().outer
    shapes = {"a": (5, 3), "b": (7,)}
    theta = random_like(shapes, 0, 1.0)
    coordinator = OuterOptimizer({n: t.clone() for n, t in theta.items()}, cfg)
    replica = OuterReplica(cfg)
    for r in range(4):
        mean = random_like(shapes, 10 + r)
        expected_params = {n: t.clone() for n, t in coordinator.params.items()}
        predicted = replica.step(expected_params, mean)
        coordinator.step(mean)
        replica.advance(mean)
        for n in shapes:
            assert torch.equal(predicted[n], coordinator.params[n]), (r, n)
    # The eager gradient: own fresh pseudo-gradient plus the others' stale ones, at the own token share.
    prev_mean, own_prev, own_fresh = ({"a": torch.tensor([v])} for v in (3.0, 1.0, 5.0))
    assert eager_gradient(prev_mean, own_prev, own_fresh, 0.25)["a"].item() == 3.0 + 0.25 * (5.0 - 1.0)


@pytest.mark.integration
def test_eager_estimate_with_one_island_is_the_exact_result(make_coordinator):
    cfg = _cfg("streaming.tau=2", "streaming.eager=true", "rounds.min_islands=1", "robust.first_quorum=1", "data.shards=1", "rounds.rounds=4")
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    seen = []
    try:
        island = Island(cfg, world, client, client.join(cfg.digest()))
        land = island.sync.land

        def spy(f: int) -> bool:
            estimate = island.sync.inflight[f].estimate
            landed = land(f)
            if estimate is not None:
                seen.append((estimate, {n: t.clone() for n, t in island.ctx.fragments[f].flat.items()}))
            return landed

        island.sync.land = spy
        result = island.run()
    finally:
        client.close()
        world.shutdown()
    assert result.checksum_matches
    assert len(seen) == 2  # rounds 1 and 2: round 0 has no previous mean, the last round adopts the result
    moved = max(float((seen[1][1][n] - seen[0][1][n]).abs().max()) for n in seen[0][1])
    assert moved > 1e-3, "the outer steps hardly moved the parameters: the comparison below would say nothing"
    for estimate, exact in seen:
        for n, t in exact.items():
            # g~ = mean_{r-1} + 1 * (pg_r - pg_{r-1}) = pg_r up to rounding: the estimate is the outer step itself.
            torch.testing.assert_close(estimate[n], t, rtol=0, atol=1e-6)
    assert checksum(island.global_params) == coordinator.state.checksum


@pytest.mark.integration
def test_streaming_run_stopped_and_resumed_ends_bit_identical(make_coordinator, tmp_path):
    """Two islands, two fragments, tau = 1, eager updates, 4-bit up and down; every process killed mid-run."""
    cfg = _cfg(
        "streaming.fragments=2", "streaming.tau=1", "streaming.eager=true", "rounds.rounds=4",
        "wire.codec='e3m0'", "wire.error_feedback=true", "eval.batches=2", "checkpoint.every_rounds=1",
        "rounds.heartbeat_s=0.5", "rounds.lease_s=8",
    )
    # The undisturbed run, in this process (the arithmetic does not depend on threads or processes).
    straight = make_coordinator(cfg)
    _run_islands(straight, cfg)
    expected = straight.state.checksum

    sim = Simulation(cfg, 2, tmp_path / "stopped", checkpoints=True)
    try:
        sim.start()
        # Pull the plug once every fragment has closed two rounds (step 4) and everyone has checkpointed it.
        kill_all_and_resume(sim, step=4, islands=2, timeout_s=60)
        summaries = list(sim.watch(100))
        resumed = sim.finish(100)
    finally:
        sim.close()
    report = resumed.report
    assert report["events"]["restarts"] == 1
    assert report["checksum"] == expected
    assert set(report["islands"].values()) == {expected}
    # Fragment 1 syncs first in every wave; in the last one both end together, in either order.
    seen = [(s.fragment, s.round) for s in summaries]
    assert seen[:6] == [(f, r) for r in range(3) for f in (1, 0)] and sorted(seen[6:]) == [(0, 3), (1, 3)]
    assert all(0 < s["compute_s"] < s["wall_s"] and s["inner_steps"] == 16 for s in report["island_stats"].values())


@pytest.mark.unit
def test_sim_prints_one_line_per_fragment_round():
    lines: list[str] = []
    printer = RoundPrinter(lines.append, fragments=2)
    for fragment in (1, 0):
        printer.print(pb.RoundSummary(round=0, fragment=fragment, fragments=2, islands=["a"], tokens=1, eval_loss=float("nan")))
    assert lines[0].split()[:3] == ["round", "frag", "islands"]
    assert [line.split()[:2] for line in lines[1:]] == [["0", "1"], ["0", "0"]]


@pytest.mark.integration
def test_streaming_fragments_keep_their_topk_residual_in_the_model(make_coordinator):
    """feedback_in_model with 2 fragments, tau 1 and alpha 0.5: each landing sets the fragment to
    alpha * local + (1 - alpha) * (global - residual); the island ends on exactly theta_global."""
    cfg = _cfg("streaming.fragments=2", "streaming.tau=1", "streaming.alpha=0.5", "rounds.min_islands=1", "robust.first_quorum=1",
               "data.shards=1",
               "wire.codec='topk'", "wire.topk_density=0.1", "wire.feedback_in_model=true", "wire.downlink_codec='int8'")
    coordinator = make_coordinator(cfg)
    checked = []
    with island_on(coordinator, cfg) as island:
        land = island.sync.land

        def check(f):
            shard = island.ctx.fragments[f]
            before = {n: t.detach().clone() for n, t in shard.local.items()}
            landed = land(f)
            if island.ctx.state.rounds[f] >= island.ctx.total_rounds:
                return landed
            for n, t in shard.local.items():
                r = island.ctx.feedback.buffers[n].view(t.shape)
                expected = 0.5 * before[n] + 0.5 * (shard.flat[n] - r)
                torch.testing.assert_close(t.detach(), expected, rtol=0, atol=1e-6)
            checked.append(f)
            return landed

        island.sync.land = check
        result = island.run()
    assert sorted(set(checked)) == [0, 1] and result.checksum_matches
    assert checksum(dict(island.ctx.model.named_parameters())) == coordinator.state.checksum
