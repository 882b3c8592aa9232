"""Robust aggregation: outlier pseudo-gradients clipped or dropped, token claims checked; honest runs untouched."""

from __future__ import annotations

import math
import random

import grpc
import numpy as np
import pytest
import torch

from conftest import tiny_config, trained_from, wait_for_round
from diloco.wire.codec import Fp32Codec
from diloco.config import RobustConfig
from diloco.wire.refusal import Reason, reason_of
from diloco.robust import NormGuard, Sketcher, opposed
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks


@pytest.mark.unit
def test_honest_norms_pass_and_an_outlier_is_clipped_to_the_reference():
    guard, rng = NormGuard(RobustConfig()), random.Random(0)
    for _ in range(50):  # honest rounds: norms within +-30% of each other, drifting down as the lr decays
        verdict = guard.judge({f"island-{i}": rng.uniform(0.7, 1.3) for i in range(3)})
        assert verdict.factors == {f"island-{i}": 1.0 for i in range(3)} and not verdict.clipped
    verdict = guard.judge({"island-0": 1.0, "island-1": 1000.0, "island-2": 1.1})
    assert verdict.clipped == ["island-1"] and verdict.factors["island-0"] == verdict.factors["island-2"] == 1.0
    assert 0.7 / 1000 <= verdict.factors["island-1"] <= 1.3 / 1000  # to the median of the others and the history
    # Alone in a round, an outlier is judged against the run's history.
    assert guard.judge({"island-1": 500.0}).clipped == ["island-1"]
    # The first round, alone: nothing to judge against.
    assert NormGuard(RobustConfig()).judge({"island-0": 1e6}).factors == {"island-0": 1.0}


@pytest.mark.unit
def test_drop_instead_of_clip_and_off_means_off_and_the_history_survives_a_checkpoint():
    drop = NormGuard(RobustConfig(action="drop"))
    drop.judge({"a": 1.0, "b": 1.1})
    verdict = drop.judge({"a": 1.0, "b": 50.0})
    assert verdict.dropped == ["b"] and verdict.factors["b"] == 0.0
    off = NormGuard(RobustConfig(enabled=False))
    assert off.judge({"a": 1.0, "b": 1e9}).factors == {"a": 1.0, "b": 1.0}
    again = NormGuard(RobustConfig())
    again.load_state_dict(drop.state_dict())
    assert again.history == drop.history and again.judge({"b": 50.0}).clipped == ["b"]


def _sketch(sketcher: Sketcher, x: torch.Tensor, splits: list[int]) -> np.ndarray:
    """x (one flat tensor named "w") sketched chunk by chunk, cut at splits."""
    out, bounds = Sketcher.empty(), [0, *splits, x.numel()]
    for a, b in zip(bounds, bounds[1:]):
        sketcher.add(out, "w", a, x[a:b].numpy())
    return out


@pytest.mark.unit
def test_sketches_estimate_cosines_whatever_the_chunks_and_differ_by_secret():
    g = torch.Generator().manual_seed(0)
    shared, own = torch.randn(300_000, generator=g), [torch.randn(300_000, generator=g) for _ in range(3)]
    a, b = shared + own[0], -0.5 * shared + own[1]  # exact cosine -0.5 / sqrt(2 x 1.25) = -0.316
    exact = float(torch.nn.functional.cosine_similarity(a, b, 0))
    sketcher = Sketcher(b"secret")
    sa, sb = _sketch(sketcher, a, [1000, 77_777]), _sketch(sketcher, b, [150_000])
    estimate = float(sa @ sb) / float((sa @ sa) ** 0.5 * (sb @ sb) ** 0.5)
    assert abs(estimate - exact) < 0.03, (estimate, exact)
    # Linear: the same tensor cut elsewhere sketches to the same buckets (up to the order of fp64 additions).
    assert np.allclose(_sketch(sketcher, a, [5, 299_000]), sa, rtol=0, atol=1e-9)
    # Another secret puts the elements elsewhere: nobody who lacks the coordinator's can aim at its buckets.
    assert not np.allclose(_sketch(Sketcher(b"another"), a, []), sa)
    # Independent noise reads as orthogonal.
    sc = _sketch(sketcher, own[2], [])
    assert abs(float(sa @ sc) / float((sa @ sa) ** 0.5 * (sc @ sc) ** 0.5)) < 0.05


@pytest.mark.unit
def test_one_contribution_against_the_majority_is_found_and_a_pair_cannot_tell():
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(4096)
    honest = {f"island-{i}": shared + rng.standard_normal(4096) for i in range(4)}  # pairwise cosines about 0.5
    assert opposed(honest, -0.1) == {}
    noise = {f"island-{i}": rng.standard_normal(4096) for i in range(5)}  # independent: cosines near 0
    assert opposed(noise, -0.1) == {}
    attacked = dict(list(honest.items())[:2], mallory=-2.7 * (shared + rng.standard_normal(4096)))
    found = opposed(attacked, -0.1)
    assert list(found) == ["mallory"] and all(c < -0.3 for c in found["mallory"])
    # Two colluding against three honest: each of the two opposes three of four others, a strict majority.
    colluding = dict(list(honest.items())[:3], m1=attacked["mallory"], m2=-2.7 * (shared + rng.standard_normal(4096)))
    assert sorted(opposed(colluding, -0.1)) == ["m1", "m2"]
    # Two contributions that oppose each other: no majority to side with, neither is singled out.
    assert opposed(dict(list(attacked.items())[1:]), -0.1) == {}


@pytest.mark.unit
def test_the_guard_drops_the_opposed_contribution_and_its_norm_stays_out_of_the_history():
    rng = np.random.default_rng(1)
    shared = rng.standard_normal(4096)
    sketches = {"a": shared + rng.standard_normal(4096), "b": shared + rng.standard_normal(4096),
                "mallory": -2.7 * (shared + rng.standard_normal(4096))}
    guard = NormGuard(RobustConfig())
    verdict = guard.judge({"a": 1.0, "b": 1.1, "mallory": 2.7}, sketches=sketches)
    assert verdict.dropped == ["mallory"] and verdict.factors == {"a": 1.0, "b": 1.0, "mallory": 0.0}
    assert guard.history == [1.05]
    # Off: folded as before.
    off = NormGuard(RobustConfig(direction_check=False)).judge({"a": 1.0, "b": 1.1, "mallory": 2.7}, sketches=sketches)
    assert off.factors == {"a": 1.0, "b": 1.0, "mallory": 1.0}


@pytest.mark.unit
def test_the_first_outer_step_waits_for_a_quorum_until_the_guard_has_a_reference():
    guard = NormGuard(RobustConfig(first_quorum=2))
    assert guard.quorum() == 2
    guard.judge({"a": 1.0, "b": 1.0})
    assert guard.quorum() == 1  # from now on a lone push is judged against the run's history
    assert NormGuard(RobustConfig()).quorum() == 2  # the default (robust.first_quorum)
    assert NormGuard(RobustConfig(first_quorum=2, enabled=False)).quorum() == 1


def _push(coordinator, stub, island: str, round_: int, pg: dict, tokens: int, steps: int):
    header = pb.PushHeader(island_id=island, round=round_, tokens=tokens, codec="fp32", inner_steps=steps,
                           global_checksum=trained_from(coordinator, round_))
    return stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=30)


@pytest.mark.integration
def test_a_poisoned_push_moves_the_global_parameters_no_more_than_an_honest_round(make_coordinator, channel_to):
    """The attack of issue 15: a finite push 1,000x the usual scale that claims 1e9 tokens."""
    # A constant inner lr: the honest pushes here are of one scale every round, which is what islands push when the lr
    # stands still (the guard judges norms per unit of the lr the round's steps train at).
    cfg = tiny_config("rounds.rounds=8", "rounds.min_islands=2", "inner.schedule='constant'")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    islands = [stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_key=k), timeout=10).island_id for k in "ab"]
    shapes = coordinator.state.manifest.shapes
    steps = cfg.inner.steps_per_round
    honest_tokens = steps * cfg.inner.batch_size * cfg.data.seq_len  # one rank, a full round

    def pg(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}

    def params() -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in coordinator.state.params.items()}

    def moved(before: dict) -> float:
        return math.sqrt(sum(float(((coordinator.state.params[n] - t) ** 2).sum()) for n, t in before.items()))

    honest = []
    for round_ in range(5):
        before = params()
        for i, island in enumerate(islands):
            _push(coordinator, stub, island, round_, pg(10 * round_ + i), honest_tokens, steps)
        wait_for_round(coordinator, round_)
        honest.append(moved(before))
    # The claim: more tokens than one rank trains in a round is refused outright.
    with pytest.raises(grpc.RpcError) as e:
        _push(coordinator, stub, islands[1], 5, pg(99, 1.0), 10**9, steps)
    assert reason_of(e.value) == Reason.BAD_REQUEST and "1000000000 tokens" in e.value.details()
    # The norm: 1,000x the usual scale, claiming an honest round's tokens, is clipped.
    before = params()
    _push(coordinator, stub, islands[0], 5, pg(50), honest_tokens, steps)
    _push(coordinator, stub, islands[1], 5, pg(51, 1.0), honest_tokens, steps)
    wait_for_round(coordinator, 5)
    poisoned = moved(before)
    summary = coordinator.state.summaries[-1]
    assert list(summary.clipped) == [islands[1]]
    assert poisoned <= 1.05 * max(honest), (poisoned, honest)
    # Unclipped, the same push would have moved them about 500x further than an honest round.
    assert poisoned < max(honest) * 2 < 1e-3 * 1000 * math.sqrt(sum(math.prod(s) for s in shapes.values()))


@pytest.mark.integration
def test_a_message_larger_than_a_chunk_is_refused_before_it_is_read(make_coordinator, channel_to):
    from coordinator.limits import max_message_bytes

    cfg = tiny_config()
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    # Two chunks and their framing, or one direction sketch, whichever is larger (tiny_config's 4 KiB chunks: the sketch).
    assert max_message_bytes(cfg) == max(2 * cfg.wire.chunk_bytes, 128 << 10) + (64 << 10)
    huge = "x" * (max_message_bytes(cfg) + 1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname=huge), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not coordinator.state.islands
    stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)  # and it serves on


@pytest.mark.integration
def test_an_island_may_hold_only_so_many_push_streams_open(make_coordinator, channel_to):
    import threading
    import time

    cfg = tiny_config()
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).island_id  # 1 rank: 2 x 1 + 2 streams
    header = pb.PushHeader(island_id=island, round=0, tokens=128, codec="fp32", inner_steps=1,
                           global_checksum=trained_from(coordinator))
    release = threading.Event()

    def held():
        yield pb.PushMessage(header=header)
        release.wait(60)

    def probe() -> int:  # a stream that ends at once: BAD_REQUEST (no PushEnd) below the bound
        with pytest.raises(grpc.RpcError) as e:
            stub.PushPseudoGradient(iter([pb.PushMessage(header=header)]), timeout=10)
        return reason_of(e.value)

    def refused(f) -> bool:
        return f.done() and reason_of(f.exception()) == Reason.TOO_MANY_STREAMS

    futures = [stub.PushPseudoGradient.future(held(), timeout=60) for _ in range(4)]
    try:
        deadline = time.monotonic() + 30
        # A probe may open before the last held stream does; that one is then refused for the bound (the same proof).
        while (reason := probe()) != Reason.TOO_MANY_STREAMS and not any(map(refused, futures)) and time.monotonic() < deadline:
            assert reason == Reason.BAD_REQUEST
            time.sleep(0.05)
        assert reason == Reason.TOO_MANY_STREAMS or sum(map(refused, futures)) == 1
    finally:
        release.set()
    for f in futures:  # the held streams end without their PushEnd: nothing kept
        assert f.exception(30) is not None and (reason_of(f.exception()) == Reason.BAD_REQUEST or refused(f))
    assert probe() == Reason.BAD_REQUEST and island not in coordinator.state.fragments[0].contributions
