from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diloco.config import ModelConfig, load_config
from diloco.model import Transformer

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
