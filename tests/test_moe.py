"""Mixture of experts (diloco/models/moe.py): routing, capacity overflow, the load-balancing loss, gradients,
parameter counts; a 1 x 2 FSDP group against one rank; a run through every codec."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import island_on, one_island_config, run_scenario, spawn_gloo_ranks, tiny_config
from coordinator.server import initial_parameters
from diloco.config import ConfigError, ModelConfig, config_from_dict, load_config
from diloco.data.sources import StepIndexedStream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.models.llama import Block, Transformer
from diloco.models.moe import MoE, expert_capacity, load_balancing_loss, route
from diloco.params import checksum

MOE = ("model.moe_experts=4", "model.moe_top_k=2")


def _cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=24, max_seq_len=16,
                       **{"moe_experts": 4, "moe_top_k": 2, **moe})


def _moe(seed: int = 0, **moe) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(_cfg(**moe))


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The definition, token by token: top-k by logit (ties to the lower index), gates renormalised (k > 1),
    each expert taking the first C choices of a sequence in token order, dropped choices adding nothing."""
    groups, tokens, _ = x.shape
    n, k = len(moe.experts), moe.top_k
    capacity = expert_capacity(tokens, n, k, moe.capacity_factor)
    logits = x @ moe.router.weight.T
    out = torch.zeros_like(x)
    for g in range(groups):
        taken = [0] * n
        for t in range(tokens):
            row = logits[g, t].tolist()
            order = sorted(range(n), key=lambda e: (-row[e], e))[:k]
            p = logits[g, t].softmax(0)[order]
            gates = p / p.sum() if k > 1 else p
            for gate, e in zip(gates, order):
                if taken[e] < capacity:
                    taken[e] += 1
                    out[g, t] += gate * moe.experts[e](x[g, t : t + 1])[0]
    return out


# --- routing and capacity ------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("top_k, factor", [(2, 1.25), (2, 0.5), (1, 1.0), (3, 0.3)])
def test_the_layer_computes_the_definition(top_k, factor):
    torch.manual_seed(1)
    moe = MoE(_cfg(moe_top_k=top_k, moe_capacity_factor=factor), lambda: nn.Sequential(nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 32)))
    x = torch.randn(3, 12, 32)
    y, _ = moe(x)
    torch.testing.assert_close(y, reference(moe, x), rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_routing_picks_the_top_k_logits_with_renormalised_gates():
    torch.manual_seed(2)
    logits = torch.randn(2, 7, 5)
    logits[0, 3] = torch.tensor([0.5, 1.0, 1.0, -1.0, 1.0])  # a three-way tie for first place
    r = route(logits, 2, 100.0)
    direct = [[sorted(range(5), key=lambda e: (-row[e], e))[:2] for row in group] for group in logits.tolist()]
    assert r.experts.tolist() == direct
    assert r.experts[0, 3].tolist() == [1, 2], "ties go to the lower expert index"
    chosen = F.softmax(logits, -1).gather(-1, r.experts)
    torch.testing.assert_close(r.gates, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(r.gates, F.softmax(logits.gather(-1, r.experts), -1))  # Mixtral's form, the same
    assert r.kept.all() and r.capacity == 7
    switch = route(logits, 1, 100.0)  # k = 1: Switch's raw probability
    torch.testing.assert_close(switch.gates[..., 0], F.softmax(logits, -1).max(-1).values)


@pytest.mark.unit
def test_capacity_overflow_drops_the_later_tokens_of_each_expert():
    # 6 tokens, 3 experts, k = 2, capacity ceil(0.5 * 6 * 2 / 3) = 2. Choices (best first):
    # t0 (0, 1), t1 (0, 2), t2 (0, 1), t3 (1, 2), t4 (2, 0), t5 (1, 0).
    logits = torch.tensor([[3, 2, 1], [3, 1, 2], [3, 2, 1], [1, 3, 2], [2, 1, 3], [2, 3, 1]], dtype=torch.float32)[None]
    r = route(logits, 2, 0.5)
    assert r.capacity == 2
    assert r.experts[0].tolist() == [[0, 1], [0, 2], [0, 1], [1, 2], [2, 0], [1, 0]]
    # Expert 0 takes t0, t1 (t2, t4, t5 overflow); expert 1 t0, t2 (t3, t5 overflow); expert 2 t1, t3 (t4 overflows).
    assert r.slot[0].tolist() == [[0, 0], [1, 0], [2, 1], [2, 1], [2, 3], [3, 4]]
    assert r.kept[0].tolist() == [[True, True], [True, True], [False, True], [False, True], [False, False], [False, False]]
    torch.manual_seed(3)
    moe = MoE(_cfg(moe_experts=3, moe_capacity_factor=0.5), lambda: nn.Linear(32, 32, bias=False))
    moe.router_logits = lambda x: logits  # whatever the input
    x = torch.randn(1, 6, 32)
    y, _ = moe(x)
    expert = [m(x[0]) for m in moe.experts]
    g = r.gates[0]
    torch.testing.assert_close(y[0, 2], g[2, 1] * expert[1][2])  # kept by one expert: its gate alone, not renormalised
    torch.testing.assert_close(y[0, 3], g[3, 1] * expert[2][3])
    torch.testing.assert_close(y[0, 0], g[0, 0] * expert[0][0] + g[0, 1] * expert[1][0])
    assert torch.equal(y[0, 4:], torch.zeros(2, 32)), "tokens that lost every choice get nothing from the experts"


@pytest.mark.unit
def test_a_token_dropped_by_every_expert_passes_through_the_residual():
    cfg = _cfg(moe_capacity_factor=0.25)  # capacity ceil(0.25 * 16 * 2 / 4) = 2 of 16 tokens
    torch.manual_seed(4)
    block = Block(cfg)
    with torch.no_grad():
        block.mlp.router.weight.zero_()  # all logits tie: every token picks experts 0 and 1
    x = torch.randn(2, 16, 32)
    cos, sin = Transformer(cfg).rope_cos, Transformer(cfg).rope_sin
    out, _ = block(x, cos, sin)
    residual = x + block.attn(block.attn_norm(x), cos, sin)
    assert torch.equal(out[:, 2:], residual[:, 2:])
    assert not torch.allclose(out[:, :2], residual[:, :2])


@pytest.mark.unit
def test_a_sequence_routes_the_same_whatever_shares_its_batch_and_the_model_stays_causal():
    model = _moe(moe_capacity_factor=0.5).eval()  # overflowing: capacity 4 of 16 tokens per expert
    a, b = torch.randint(0, 50, (2, 3, 16))
    torch.testing.assert_close(model(torch.cat([a, b]))[:3], model(a), rtol=0, atol=1e-5)
    changed = a.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    torch.testing.assert_close(model(a)[:, :10], model(changed)[:, :10])


# --- the auxiliary loss --------------------------------------------------------------------------


@pytest.mark.unit
def test_load_balancing_loss_is_switchs_formula_and_one_for_uniform_routing():
    # One group, k = 1: f = (1, 0), P = (0.7, 0.3): 2 * 0.7.
    probs = torch.tensor([[[0.8, 0.2], [0.6, 0.4]]])
    assert load_balancing_loss(probs, torch.tensor([[[0], [0]]])).item() == pytest.approx(1.4)
    # k = 2 over 4 experts: f = (2, 1, 1, 0) / 4, P = (.45, .2, .25, .1): 4 * 0.3375; the mean over groups.
    probs = torch.tensor([[[0.4, 0.3, 0.2, 0.1], [0.5, 0.1, 0.3, 0.1]]])
    experts = torch.tensor([[[0, 1], [0, 2]]])
    assert load_balancing_loss(probs, experts).item() == pytest.approx(1.35)
    two = load_balancing_loss(torch.cat([probs, torch.full_like(probs, 0.25)]), torch.cat([experts, experts]))
    assert two.item() == pytest.approx((1.35 + 1.0) / 2)
    # Uniform routing gives exactly 1: uniform probabilities whatever the choices, balanced choices whatever P.
    assert load_balancing_loss(torch.full((3, 8, 4), 0.25), torch.randint(0, 4, (3, 8, 2))).item() == pytest.approx(1.0)
    balanced = torch.tensor([[[0, 1], [2, 3]]])
    assert load_balancing_loss(torch.softmax(torch.randn(1, 2, 4), -1), balanced).item() == pytest.approx(1.0)
    # 1 is the balanced value, not a lower bound: f piled on an expert of low mean probability goes under it.
    skewed = torch.tensor([[[0.51, 0.49], [0.51, 0.49], [0.0, 1.0]]])
    assert load_balancing_loss(skewed, torch.tensor([[[0], [0], [1]]])).item() < 1.0


@pytest.mark.unit
def test_the_training_loss_adds_the_coefficient_times_the_blocks_mean_and_eval_is_cross_entropy():
    model = _moe(moe_aux_loss_coef=0.1)
    tokens, targets = torch.randint(0, 50, (2, 3, 16))
    logits, loss = model(tokens, targets)
    ce = F.cross_entropy(logits.view(-1, 50), targets.reshape(-1))
    h = model.embed(tokens)
    aux = []
    for block in model.blocks:
        h, a = block(h, model.rope_cos, model.rope_sin)
        aux.append(a)
    assert model.aux_loss.item() == pytest.approx(torch.stack(aux).mean().item())
    assert 1.0 <= model.aux_loss.item() < 1.5  # near-uniform routing at init
    torch.testing.assert_close(loss, ce + 0.1 * torch.stack(aux).mean())
    model.eval()
    torch.testing.assert_close(model(tokens, targets)[1], ce)


# --- gradients and sizes -------------------------------------------------------------------------


@pytest.mark.unit
def test_gradients_reach_the_router_and_every_expert_even_an_unused_one():
    model = _moe()
    tokens, targets = torch.randint(0, 50, (2, 4, 16))
    model(tokens, targets)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.blocks[0].mlp.router.weight.zero_()  # ties: block 0 sends everything to experts 0 and 1
    model(tokens, targets)[1].backward()
    # Experts 2 and 3 of block 0 saw only empty slots: a gradient of zeros, but a gradient (FSDP, torchft).
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert (p.grad.abs().sum() == 0) == (name.startswith(("blocks.0.mlp.experts.2.", "blocks.0.mlp.experts.3."))), name


@pytest.mark.unit
def test_parameter_counts_total_and_active_and_equal_active_dense():
    moe, cfg = _moe(), _cfg()
    dense = Transformer(replace(cfg, moe_experts=0, d_ff=2 * cfg.d_ff))  # d_ff = top_k * expert d_ff
    expert = 3 * 32 * 24
    names = [n for n, _ in moe.named_parameters()]
    assert "blocks.1.mlp.experts.3.down_proj.weight" in names and "blocks.0.mlp.router.weight" in names
    assert moe.num_parameters() == dense.num_parameters() + 2 * (2 * expert + 4 * 32)  # per block: 2 more experts, a router
    assert moe.active_parameters() == dense.active_parameters() + 2 * 4 * 32 == dense.num_parameters() + 256
    assert moe.flops_per_token(16) == dense.flops_per_token(16) + 6 * 256
    # Experts are 2-D matrices with the dense MLP's names, depth-scaled init included.
    assert all(p.dim() == 2 for n, p in moe.named_parameters() if ".experts." in n)


@pytest.mark.unit
def test_config_validates_and_a_dense_run_hashes_as_before():
    plain = load_config(None)
    # In a config file (a --set of them without experts is refused: test_config.py).
    assert config_from_dict({"model": {"moe_top_k": 1, "moe_capacity_factor": 2.0}}).digest() == plain.digest()
    assert load_config(None, list(MOE)).digest() != plain.digest()
    for bad in (["model.moe_experts=1"], [*MOE, "model.moe_top_k=5"], [*MOE, "model.moe_capacity_factor=0.0"],
                [*MOE, "model.moe_aux_loss_coef=-1.0"], ["model.moe_experts=-2"]):
        with pytest.raises(ConfigError, match="moe_experts"):
            load_config(None, bad)


@pytest.mark.integration
def test_export_refuses_a_mixture_of_experts_with_one_line(make_coordinator, tmp_path, capsys):
    from kit import coordinator_checkpoint, export_cli, one_error_line

    from diloco.models.hf import HFError, to_hf

    url = str(tmp_path / "ckpt")
    cfg, params = coordinator_checkpoint(make_coordinator, url, *MOE, push=False)
    line = one_error_line(capsys, export_cli(url, tmp_path / "hf"))
    assert "mixture of experts (model.moe_experts=4)" in line and "dense Llama only" in line, line
    assert not (tmp_path / "hf").exists()
    with pytest.raises(HFError, match="not a Llama model"):
        to_hf(params, cfg.model)


# --- a 1 x 2 FSDP group against one rank ---------------------------------------------------------

STEPS, BATCH = 4, 8


def _fsdp_cfg():
    # Overflowing capacity (factor 0.5) and a d_ff of 37 rows, which FSDP2 shards unevenly.
    return tiny_config(*MOE, "model.n_layers=2", "model.d_ff=37", "model.moe_capacity_factor=0.5",
                       "model.moe_aux_loss_coef=0.1", "inner.warmup_steps=2")


def _train(model, cfg, part: slice) -> None:
    """STEPS AdamW steps on `part` of each step's batch of BATCH sequences."""
    optimizer = build_inner_optimizer(model, cfg.inner)
    data = StepIndexedStream(cfg.data, 0, 0, 1)
    for step in range(STEPS):
        inputs, targets = data.batch_at(step, BATCH)
        train_step(model, optimizer, (inputs[part], targets[part]), inner_lr(step, STEPS, cfg.inner), cfg.inner.grad_clip)


def _rank(rank: int, world_size: int, workdir: str) -> None:
    """One rank of the group: half of every batch, FSDP2 averaging the gradients over the two halves."""
    from islands.fsdp import build_sharded_model, local_views, shard_range

    torch.set_num_threads(1)
    cfg = _fsdp_cfg()
    torch.manual_seed(0)
    start = dict(Transformer(cfg.model).named_parameters())
    model = build_sharded_model(cfg.model, torch.device("cpu"), world_size)[0]
    ranges = {n: shard_range(n, p) for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, view in local_views(model).items():
            view.copy_(start[name].reshape(-1)[ranges[name].offset : ranges[name].offset + ranges[name].numel])
    half = BATCH // world_size
    _train(model, cfg, slice(rank * half, (rank + 1) * half))
    torch.save({"ranges": {n: (r.offset, r.numel) for n, r in ranges.items()},
                "model": {n: t.clone() for n, t in local_views(model).items()}}, Path(workdir) / f"rank{rank}.pt")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_a_sharded_group_on_half_batches_steps_as_one_rank_on_the_whole(tmp_path, monkeypatch):
    spawn_gloo_ranks(_rank, 2, tmp_path, monkeypatch)
    cfg = _fsdp_cfg()
    torch.manual_seed(0)
    single = Transformer(cfg.model)
    start = {n: p.detach().clone() for n, p in single.named_parameters()}
    _train(single, cfg, slice(0, BATCH))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, p in single.named_parameters():
            offset, numel = got["ranges"][name]
            expected = p.detach().reshape(-1)[offset : offset + numel]
            torch.testing.assert_close(got["model"][name], expected, rtol=0, atol=2e-6, msg=f"rank {rank}: {name}")
            if numel:
                assert not torch.equal(expected, start[name].reshape(-1)[offset : offset + numel]), f"{name} never moved"


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_2x2_sharded_island_and_a_one_rank_island_end_on_the_coordinators_parameters(tmp_path):
    from kit import assemble_shards, assert_equals_coordinator, assert_every_round_whole

    result = run_scenario("moe_scenarios.py", "sharded_and_single", tmp_path, 240)
    assert result["notes"]["exit_codes"] == {"sharded": 0, "single": 0}
    assert_every_round_whole(result, islands=2)
    assert set(result["islands"].values()) == {result["checksum"]}
    coordinator = torch.load(tmp_path / "coordinator.pt")
    for group in (0, 1):
        assert_equals_coordinator(assemble_shards(tmp_path / "sharded", group, 0, 2), coordinator, f"group {group}")


# --- through every codec -------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "e3m0", "topk"])
def test_an_moe_island_ends_on_the_coordinators_parameters_through_every_codec(make_coordinator, codec):
    # The downlink uses the same codec: a lossy one sends the round's update compressed.
    cfg = one_island_config(*MOE, "model.d_ff=32", "model.moe_capacity_factor=1.0", f"wire.codec='{codec}'", "rounds.rounds=3",
                      "inner.steps_per_round=3")
    coordinator = make_coordinator(cfg)
    with island_on(coordinator, cfg) as island:
        result = island.run()
    assert result.rounds == 3 and result.checksum_matches
    assert checksum(island.global_params) == coordinator.state.checksum
    assert checksum(dict(island.ctx.model.named_parameters())) == coordinator.state.checksum
    assert all(torch.isfinite(torch.tensor(result.losses)))
    initial = initial_parameters(cfg)
    for name in ("blocks.0.mlp.router.weight", "blocks.0.mlp.experts.3.up_proj.weight"):
        assert not torch.equal(coordinator.state.params[name], initial[name]), f"{name} never moved"
