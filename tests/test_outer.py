"""The outer step through a live coordinator: pinned against torch's SGD and the token-weighted mean."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import claim, one_island_config, random_like, tiny_config, trained_from
from diloco.wire.codec import Fp32Codec
from diloco.config import OuterConfig
from diloco.outer import OuterOptimizer, PseudoGradientAccumulator
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import Manifest, tensor_chunks
from islands.client import CoordinatorClient, ReplayableChunks


def _clients(coordinator, ranks: list[int]):
    """An island per entry of ranks, each joined declaring that many ranks."""
    clients = [CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10) for _ in ranks]
    joined = [c.join(ranks=r) for c, r in zip(clients, ranks)]
    return clients, joined


def _fetch(client, island_id, manifest):
    params = {k: torch.zeros(s) for k, s in manifest.shapes.items()}
    header = client.fetch(island_id, params, manifest)
    return header, params


def _push(coordinator, client, island_id, round_, claimed: dict, pg, chunk_bytes):
    header = pb.PushHeader(island_id=island_id, round=round_, train_loss=1.0, codec="fp32", **claimed,
                           global_checksum=trained_from(coordinator, round_))
    return client.push(header, ReplayableChunks(tensor_chunks(pg, Fp32Codec(), chunk_bytes)))


@pytest.mark.integration
def test_outer_step_matches_torch_sgd_nesterov_on_token_weighted_mean(make_coordinator):
    cfg = tiny_config("outer.lr=0.7", "outer.momentum=0.9", "rounds.rounds=3")
    coordinator = make_coordinator(cfg)
    ranks = [3, 1]  # one inner step on each rank: 3:1 tokens
    clients, joined = _clients(coordinator, ranks)
    manifest = Manifest.from_proto(joined[0].parameters)
    try:
        _, theta = _fetch(clients[0], joined[0].island_id, manifest)
        reference = {k: v.clone() for k, v in theta.items()}
        sgd = torch.optim.SGD(list(reference.values()), lr=0.7, momentum=0.9, nesterov=True)
        claims = [claim(cfg, 1, r) for r in ranks]
        tokens = [c["tokens"] for c in claims]
        for round_ in range(3):
            pgs = [random_like(manifest.shapes, seed=10 * round_ + i) for i in range(2)]
            for client, j, c, pg in zip(clients, joined, claims, pgs):
                _push(coordinator, client, j.island_id, round_, c, pg, cfg.wire.chunk_bytes)
            header = clients[0].pull(joined[0].island_id, round_, theta, manifest, "", timeout_s=20)
            assert header.round == round_ + 1
            for name, p in reference.items():
                p.grad = (tokens[0] * pgs[0][name] + tokens[1] * pgs[1][name]) / sum(tokens)
            sgd.step()
            for name in theta:
                torch.testing.assert_close(theta[name], reference[name], rtol=1e-6, atol=1e-7)
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
def test_lr1_momentum0_gives_token_weighted_mean_of_island_parameters(make_coordinator):
    cfg = tiny_config("outer.lr=1.0", "outer.momentum=0.0", "rounds.rounds=1")
    coordinator = make_coordinator(cfg)
    ranks = [1, 2, 7]  # one inner step on each rank: 1:2:7 tokens
    clients, joined = _clients(coordinator, ranks)
    manifest = Manifest.from_proto(joined[0].parameters)
    try:
        _, theta_global = _fetch(clients[0], joined[0].island_id, manifest)
        claims = [claim(cfg, 1, r) for r in ranks]
        tokens = [c["tokens"] for c in claims]
        # Each island moves to its own parameters; the pseudo-gradient is global - local.
        locals_ = [{n: theta_global[n] + d for n, d in random_like(manifest.shapes, seed=i, scale=0.1).items()} for i in range(3)]
        for client, j, c, local in zip(clients, joined, claims, locals_):
            pg = {n: theta_global[n] - local[n] for n in local}
            _push(coordinator, client, j.island_id, 0, c, pg, cfg.wire.chunk_bytes)
        result = {k: torch.zeros(s) for k, s in manifest.shapes.items()}
        clients[0].pull(joined[0].island_id, 0, result, manifest, "", timeout_s=20)
        for name in result:
            expected = sum(t * local[name] for t, local in zip(tokens, locals_)) / sum(tokens)
            torch.testing.assert_close(result[name], expected, rtol=1e-5, atol=1e-6)
            # The sign is right: the result moved away from the global start towards the islands.
            assert not torch.equal(result[name], theta_global[name])
    finally:
        for c in clients:
            c.close()


@pytest.mark.unit
def test_accumulator_single_contribution_is_exact():
    pg = random_like({"w": (7, 5)}, seed=3)
    acc = PseudoGradientAccumulator({"w": (7, 5)})
    acc.add(12345, pg)
    assert torch.equal(acc.mean()["w"], pg["w"])


@pytest.mark.unit
def test_accumulator_weights_by_tokens_and_resets():
    a, b = torch.ones(4), torch.full((4,), 4.0)
    acc = PseudoGradientAccumulator({"w": (4,)})
    acc.add(300, {"w": a})
    acc.add(100, {"w": b})
    torch.testing.assert_close(acc.mean()["w"], torch.full((4,), 1.75))
    acc.reset()
    assert acc.contributions == 0 and float(acc.sums["w"].abs().sum()) == 0.0


@pytest.mark.unit
def test_accumulator_mean_is_divided_in_place_to_the_same_bits():
    pgs = [random_like({"w": (64, 33)}, seed=s) for s in (1, 2, 3)]
    tokens = (1000, 1700, 900)
    acc = PseudoGradientAccumulator({"w": (64, 33)})
    for t, pg in zip(tokens, pgs):
        acc.add(t, pg)
    expected = acc.sums["w"] / (sum(tokens) / tokens[0])  # what a separate buffer would hold
    sums = acc.sums["w"]
    mean = acc.mean()["w"]
    assert mean.data_ptr() == sums.data_ptr()  # no second model-sized buffer
    assert torch.equal(mean, expected)
    assert torch.equal(acc.mean()["w"], expected)  # asking again does not divide again
    with pytest.raises(RuntimeError, match="reset"):
        acc.add(5, pgs[0])
    acc.reset()
    acc.add(5, pgs[0])
    assert torch.equal(acc.mean()["w"], pgs[0]["w"])


@pytest.mark.unit
def test_the_mean_divided_a_span_at_a_time_from_threads_is_the_mean():
    """mean_spans (the coordinator divides each span where the outer step reads it): spans of odd sizes, in shuffled
    order, from four threads, give mean()'s bits; one island, or a mean divided already, is not divided again."""
    shapes = {"w": (64, 33), "b": (7,)}
    pgs = [random_like(shapes, seed=s) for s in (1, 2, 3)]
    whole, spans = PseudoGradientAccumulator(shapes), PseudoGradientAccumulator(shapes)
    for acc in (whole, spans):
        for t, pg in zip((1000, 1700, 900), pgs):
            acc.add(t, pg)
    expected = whole.mean()
    span = spans.mean_spans()
    cuts = [(n, lo, min(lo + 13, t.numel())) for n, t in spans.sums.items() for lo in range(0, t.numel(), 13)]
    random.Random(0).shuffle(cuts)
    with ThreadPoolExecutor(4) as pool:
        views = list(pool.map(lambda c: span(*c), cuts))
    for (name, lo, hi), view in zip(cuts, views):
        assert view.data_ptr() == spans.sums[name].view(-1)[lo:].data_ptr()  # in place
    for n in shapes:
        assert torch.equal(spans.sums[n], expected[n]), n
    assert torch.equal(spans.mean_spans()("w", 0, 5), expected["w"].view(-1)[:5])  # divided once only
    one = PseudoGradientAccumulator(shapes)
    one.add(1000, pgs[0])
    assert torch.equal(one.mean_spans()("w", 0, 64 * 33), pgs[0]["w"].view(-1))
    with pytest.raises(RuntimeError, match="no contribution"):
        PseudoGradientAccumulator(shapes).mean_spans()


@pytest.mark.unit
def test_a_contribution_trained_on_no_tokens_does_not_dilute_the_others():
    shapes = {"w": (3, 4)}
    a, b = random_like(shapes, seed=1), random_like(shapes, seed=2)
    acc = PseudoGradientAccumulator(shapes)
    acc.add(0, b)  # an island that resynced at its round's end: no steps, no weight (first, so no reference yet)
    acc.add(700, a)
    assert torch.equal(acc.mean()["w"], a["w"])
    empty = PseudoGradientAccumulator(shapes)
    empty.add(0, b)
    assert torch.equal(empty.mean()["w"], torch.zeros(3, 4))  # nobody trained: no update
    with pytest.raises(ValueError, match=">= 0"):
        empty.scale_for(-1)


@pytest.mark.unit
@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (True, 0.0)])
def test_an_outer_step_that_consumes_its_pseudo_gradient_is_torch_sgd_bit_for_bit(nesterov, momentum):
    """The coordinator's step forms Nesterov's look-ahead in the mean it was given (no model-sized temporary):
    the same bits as torch.optim.SGD, round after round, and the momentum it keeps is torch's, so checkpoints and
    a step without consume continue it exactly."""
    torch.manual_seed(0)
    shapes = {"a": (300, 70), "b": (5000,), "c": (1,)}
    ours = {n: torch.randn(s) for n, s in shapes.items()}
    reference = {n: t.clone() for n, t in ours.items()}
    outer = OuterOptimizer(ours, OuterConfig(lr=0.7, momentum=momentum, nesterov=nesterov))
    sgd = torch.optim.SGD(list(reference.values()), lr=0.7, momentum=momentum, nesterov=nesterov and momentum > 0)
    for round_ in range(5):
        mean = {n: torch.randn(s) * 1e-2 for n, s in shapes.items()}
        for n, p in reference.items():
            p.grad = mean[n].clone()
        sgd.step()
        outer.step({n: t.clone() for n, t in mean.items()}, consume=round_ < 4)  # the last round through torch's step
        for n in shapes:
            assert torch.equal(ours[n], reference[n]), (round_, n)
    ours_state, torch_state = outer.state_dict()["state"], sgd.state_dict()["state"]
    assert ours_state.keys() == torch_state.keys()
    for k, state in torch_state.items():
        buf = state.get("momentum_buffer")
        assert (buf is None) == (ours_state[k].get("momentum_buffer") is None)
        assert buf is None or torch.equal(ours_state[k]["momentum_buffer"], buf)


@pytest.mark.unit
@pytest.mark.parametrize("width", [37, 4099])
def test_an_outer_step_taken_a_span_at_a_time_on_threads_is_torch_sgd_bit_for_bit(width):
    """span_step (the coordinator steps each published chunk's span while it is in cache): spans of odd sizes that
    split vector widths, in shuffled order, from four threads, over five rounds (the first allocates the momentum):
    the parameters and momentum are torch.optim.SGD's, bit for bit."""
    torch.manual_seed(3)
    shapes = {"a": (300, 70), "b": (5001,), "c": (1,)}
    ours = {n: torch.randn(s) for n, s in shapes.items()}
    reference = {n: t.clone() for n, t in ours.items()}
    outer = OuterOptimizer(ours, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    sgd = torch.optim.SGD(list(reference.values()), lr=0.7, momentum=0.9, nesterov=True)
    rng = random.Random(1)
    for round_ in range(5):
        mean = {n: torch.randn(s) * 1e-2 for n, s in shapes.items()}
        for n, p in reference.items():
            p.grad = mean[n].clone()
        sgd.step()
        step = outer.span_step()
        cuts = [(n, lo, min(lo + width, t.numel())) for n, t in mean.items() for lo in range(0, t.numel(), width)]
        rng.shuffle(cuts)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda c: step(*c, mean[c[0]].view(-1)[c[1]:c[2]]), cuts))
        for n, p in reference.items():
            assert torch.equal(ours[n], p), (round_, n)
            assert torch.equal(outer.optimizer.state[ours[n]]["momentum_buffer"], sgd.state[p]["momentum_buffer"]), (round_, n)
    delayed = OuterOptimizer({"w": torch.zeros(3)}, OuterConfig(lr=0.7, momentum=0.9, nesterov=False))
    with pytest.raises(RuntimeError, match="Nesterov"):
        delayed.span_step()


@pytest.mark.integration
def test_a_round_on_no_tokens_takes_no_outer_step(make_coordinator):
    """Every contribution of a round trained on 0 tokens (an island that resynced at its round's end pushes with no
    weight): the round closes and moves on, but a step on momentum alone would move the parameters with no data behind
    it, so parameters, momentum and checksum stay; the next round with weight steps again."""
    cfg = one_island_config("outer.momentum=0.9", "rounds.rounds=3")
    coordinator = make_coordinator(cfg)
    clients, joined = _clients(coordinator, [1])
    client, island = clients[0], joined[0].island_id
    manifest = Manifest.from_proto(joined[0].parameters)
    fragment = coordinator.state.fragments[0]

    def snapshot():
        momentum = [s["momentum_buffer"].clone() for s in fragment.outer.optimizer.state.values()]
        return {n: t.clone() for n, t in fragment.outer.params.items()}, momentum, fragment.checksum

    try:
        _, theta = _fetch(client, island, manifest)
        for round_, claimed in enumerate([claim(cfg), {"tokens": 0, "inner_steps": 1}, claim(cfg)]):
            before = snapshot()
            _push(coordinator, client, island, round_, claimed, random_like(manifest.shapes, seed=round_), cfg.wire.chunk_bytes)
            header = client.pull(island, round_, theta, manifest, before[2], timeout_s=20)
            assert header.round == round_ + 1 and header.checksum == fragment.checksum
            params, momentum, checksum_ = snapshot()
            moved = any(not torch.equal(params[n], before[0][n]) for n in params)
            assert moved == bool(claimed["tokens"]), round_
            assert (checksum_ == before[2]) == (not claimed["tokens"])
            if not claimed["tokens"]:
                assert all(torch.equal(a, b) for a, b in zip(momentum, before[1]))
        assert [s.tokens for s in coordinator.state.summaries] == [claim(cfg)["tokens"], 0, claim(cfg)["tokens"]]
    finally:
        client.close()
