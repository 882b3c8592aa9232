from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from diloco.config import ModelConfig, load_config
from diloco.models.llama import Transformer

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _small():
    return ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=16)


def test_forward_shapes_and_loss_near_uniform_at_init():
    torch.manual_seed(0)
    model = Transformer(_small())
    tokens, targets = torch.randint(0, 50, (2, 3, 16))
    logits, loss = model(tokens, targets)
    assert logits.shape == (3, 16, 50)
    assert abs(loss.item() - torch.log(torch.tensor(50.0)).item()) < 0.2


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = Transformer(_small())
    a = torch.randint(0, 50, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 50
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])
    assert not torch.allclose(model(a)[0, 10:], model(b)[0, 10:])


def test_output_projection_is_tied_to_embedding():
    model = Transformer(_small())
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n or "output" in n for n in names)
    with torch.no_grad():
        model.embed.weight.zero_()
    assert float(model(torch.zeros(1, 4, dtype=torch.long)).detach().abs().sum()) == 0.0


def test_untied_model_has_its_own_output_projection():
    model = Transformer(replace(_small(), tie_embeddings=False))
    assert model.lm_head.weight.shape == (50, 32) and model.lm_head.weight is not model.embed.weight
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert float(model(torch.zeros(1, 4, dtype=torch.long)).detach().abs().sum()) == 0.0
    # An input embedding is a lookup: it costs no FLOPs, a tied one is the output matmul's matrix.
    tied, untied = Transformer(_small()), model
    assert untied.flops_per_token(16) == tied.flops_per_token(16)


def test_parameter_names_shapes_and_count_follow_llama():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=16, tie_embeddings=False)
    shapes = {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}
    head = 32 // 4
    assert shapes["blocks.1.attn.q_proj.weight"] == (4 * head, 32)
    assert shapes["blocks.1.attn.k_proj.weight"] == shapes["blocks.1.attn.v_proj.weight"] == (2 * head, 32)  # grouped
    assert shapes["blocks.1.attn.o_proj.weight"] == (32, 4 * head)
    assert shapes["blocks.1.mlp.gate_proj.weight"] == shapes["blocks.1.mlp.up_proj.weight"] == (48, 32)
    assert shapes["blocks.1.mlp.down_proj.weight"] == (32, 48)
    per_block = 32 * 32 + 2 * (2 * head * 32) + 32 * 32 + 3 * 32 * 48 + 2 * 32
    assert sum(math.prod(s) for s in shapes.values()) == 2 * per_block + 2 * 50 * 32 + 32
    assert Transformer(cfg).num_parameters() == 2 * per_block + 2 * 50 * 32 + 32


def test_the_mlp_is_swiglu():
    model = Transformer(_small())
    mlp, x = model.blocks[0].mlp, torch.randn(3, 32)
    expected = mlp.down_proj.weight @ (torch.nn.functional.silu(mlp.gate_proj.weight @ x.T) * (mlp.up_proj.weight @ x.T))
    torch.testing.assert_close(mlp(x), expected.T)


def test_grouped_query_attention_equals_multi_head_with_repeated_key_value_heads():
    """Query head h reads key/value head h // group (Hugging Face's repeat_kv), not h % n_kv_heads."""
    torch.manual_seed(0)
    gqa = Transformer(replace(_small(), n_kv_heads=2))
    mha = Transformer(_small())
    state = gqa.state_dict()
    for name in [n for n in state if n.endswith(("k_proj.weight", "v_proj.weight"))]:
        state[name] = state[name].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens))


def test_residual_projections_start_scaled_by_depth():
    torch.manual_seed(0)
    cfg = replace(_small(), n_layers=8, d_model=256, n_heads=4, d_ff=512)
    model = Transformer(cfg)
    deep = torch.cat([model.blocks[i].attn.o_proj.weight.flatten() for i in range(8)]).std().item()
    plain = torch.cat([model.blocks[i].attn.q_proj.weight.flatten() for i in range(8)]).std().item()
    assert abs(plain - 0.02) < 1e-3 and abs(deep - 0.02 / math.sqrt(16)) < 1e-3


def test_the_tiny_preset_is_the_embedded_default():
    assert load_config(ROOT / "configs" / "tiny.toml").model == ModelConfig()
    assert 0.75e6 < Transformer(ModelConfig()).num_parameters() < 0.85e6  # the README's "~0.8M-parameter" demo


def test_rejects_sequences_longer_than_max_seq_len():
    with pytest.raises(ValueError, match="exceeds model.max_seq_len"):
        Transformer(_small())(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("preset, low, high", [("tiny", 0.5e6, 1.5e6), ("125m", 100e6, 150e6), ("1b", 0.9e9, 1.5e9), ("7b", 6e9, 8e9)])
def test_presets_have_their_advertised_size(preset, low, high):
    cfg = load_config(ROOT / "configs" / f"{preset}.toml")
    if cfg.data.source == "tokens":
        assert cfg.model.vocab_size == 0  # taken from the corpus: size it with a GPT-2-sized vocabulary
        cfg.model.vocab_size = 50304
    with torch.device("meta"):
        n = Transformer(cfg.model).num_parameters()
    assert low <= n <= high, f"{preset}: {n / 1e6:.1f}M parameters"


@pytest.mark.parametrize("overrides", [(), ("model.moe_experts=4",), ("model.tie_embeddings=false",)])
def test_parameters_made_one_at_a_time_are_the_models_own(overrides):
    """A coordinator shard makes only its parameters (diloco.models.llama.initial_parameters), yet each equals what the
    whole model constructed from the seed holds, bit for bit."""
    from diloco.models.llama import initial_parameters
    from diloco.params import fp32_copy

    cfg = load_config(None, list(overrides))
    torch.manual_seed(cfg.seed)
    whole = fp32_copy(Transformer(cfg.model))
    assert initial_parameters(cfg.model, cfg.seed).keys() == whole.keys()
    part = initial_parameters(cfg.model, cfg.seed, lambda name: name.startswith("blocks.1."))
    assert part and all(torch.equal(t, whole[n]) for n, t in part.items()) and set(part) < set(whole)
    assert all(torch.equal(t, whole[n]) for n, t in initial_parameters(cfg.model, cfg.seed).items())
