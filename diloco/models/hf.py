"""Our decoder as Hugging Face's Llama, and back: the one place that knows both sets of names.

diloco/models/llama.py names a block's parameters as LlamaForCausalLM does (q_proj ... down_proj) and uses
the same rotate-half rotary layout, so the mapping is a renaming with no reshaping:

    embed.weight                         model.embed_tokens.weight
    blocks.{i}.attn_norm.weight          model.layers.{i}.input_layernorm.weight
    blocks.{i}.attn.{q,k,v,o}_proj.*     model.layers.{i}.self_attn.{q,k,v,o}_proj.*
    blocks.{i}.mlp_norm.weight           model.layers.{i}.post_attention_layernorm.weight
    blocks.{i}.mlp.{gate,up,down}_proj.* model.layers.{i}.mlp.{gate,up,down}_proj.*
    norm.weight                          model.norm.weight
    lm_head.weight (untied only)         lm_head.weight

A tied model has no lm_head in either form: config.json's tie_word_embeddings tells transformers to
reuse the embedding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diloco.config import ModelConfig
from diloco.models.llama import Transformer

ARCHITECTURE = "LlamaForCausalLM"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The run's config (TOML) beside an export: diloco-eval takes its held-out data and eval settings from it.
RUN_CONFIG = "diloco_run.toml"

_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
_TOP_BACK = {v: k for k, v in _TOP.items()}
# Inside a block: our prefix -> HF's (the leaf names are the same).
_BLOCK = (("attn_norm.", "input_layernorm."), ("mlp_norm.", "post_attention_layernorm."), ("attn.", "self_attn."), ("mlp.", "mlp."))
_OURS = re.compile(r"^blocks\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFError(ValueError):
    """A state dict or folder that does not map between our model and HF Llama; the message says why."""


def hf_name(name: str) -> str:
    """Hugging Face Llama's name for one of our parameters."""
    if name in _TOP:
        return _TOP[name]
    m = _OURS.match(name)
    for ours, theirs in _BLOCK if m else ():
        if m.group(2).startswith(ours):
            return f"model.layers.{m.group(1)}.{theirs}{m.group(2)[len(ours):]}"
    raise HFError(f"parameter {name!r} has no Hugging Face Llama name")


def our_name(name: str) -> str:
    """Our name for one of Hugging Face Llama's parameters."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _THEIRS.match(name)
    for ours, theirs in _BLOCK if m else ():
        if m.group(2).startswith(theirs):
            return f"blocks.{m.group(1)}.{ours}{m.group(2)[len(theirs):]}"
    raise HFError(f"Hugging Face parameter {name!r} is not one of a Llama decoder's")


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our parameter names and shapes for cfg (built on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        return {n: p.shape for n, p in Transformer(cfg).named_parameters()}


def check_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """HFError unless state_dict holds exactly cfg's parameters, with their shapes."""
    want = expected_shapes(cfg)
    missing, extra = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
    if missing or extra:
        raise HFError(f"parameters do not match the model config: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in want.items():
        if tuple(state_dict[name].shape) != tuple(shape):
            raise HFError(f"{name} has shape {tuple(state_dict[name].shape)}, the model config says {tuple(shape)}")


def to_hf(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (checked against cfg) under LlamaForCausalLM's names; the tensors are not copied."""
    if cfg.moe_experts:  # its names would map (blocks.i.mlp.router...), into a folder transformers cannot load
        raise HFError(f"a mixture of experts (moe_experts={cfg.moe_experts}) is not a Llama model")
    check_state_dict(state_dict, cfg)
    return {hf_name(n): t.detach() for n, t in state_dict.items()}


def hf_config(cfg: ModelConfig, *, eos_id: int | None = None, bos_id: int | None = None,
              dtype: str = "float32") -> dict[str, Any]:
    """config.json for LlamaForCausalLM. Token ids not known are written as null: HF's defaults (1, 2)
    would name tokens our vocabulary does not reserve."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads the legacy key into rope_parameters; 4.x reads it as is.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
    }


def model_config_from_hf(config: Mapping[str, Any]) -> ModelConfig:
    """Our ModelConfig for a Llama config.json; HFError for what our decoder does not have."""
    if config.get("model_type") != "llama":
        raise HFError(f"model_type is {config.get('model_type')!r}, not 'llama'")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = [
        (config.get("attention_bias", False), "attention_bias"),
        (config.get("mlp_bias", False), "mlp_bias"),
        (config.get("hidden_act", "silu") != "silu", f"hidden_act {config.get('hidden_act')!r}"),
        (rope_type != "default", f"rope scaling {rope_type!r}"),
    ]
    heads, d_model = int(config["num_attention_heads"]), int(config["hidden_size"])
    unsupported.append((int(config.get("head_dim") or d_model // heads) * heads != d_model, "head_dim * heads != hidden_size"))
    found = [what for bad, what in unsupported if bad]
    if found:
        raise HFError(f"this Llama uses {', '.join(found)}, which diloco's decoder does not have")
    kv = int(config.get("num_key_value_heads") or heads)
    return ModelConfig(
        vocab_size=int(config["vocab_size"]), d_model=d_model, n_layers=int(config["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=0 if kv == heads else kv, d_ff=int(config["intermediate_size"]),
        max_seq_len=int(config.get("max_position_embeddings", 2048)),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        init_std=float(config.get("initializer_range", 0.02)),
        # LlamaConfig's defaults, for a config.json that leaves them out.
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
    )


def read_weights(path: str | Path, storage_options: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's model.safetensors, or of the shards its index names (local or any fsspec URL)."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem
    from safetensors.torch import load, load_file

    fs, root = fsspec.core.url_to_fs(str(path), **(storage_options or {}))
    root = root.rstrip("/")

    def read(name: str) -> dict[str, torch.Tensor]:
        # A local file is memory-mapped; a remote one is read whole (safetensors parses bytes).
        return load_file(f"{root}/{name}") if isinstance(fs, LocalFileSystem) else load(fs.cat_file(f"{root}/{name}"))

    if fs.isfile(f"{root}/{WEIGHTS}"):
        return read(WEIGHTS)
    if not fs.isfile(f"{root}/{INDEX}"):
        raise HFError(f"{path}: no {WEIGHTS} and no {INDEX}")
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(fs.cat_file(f"{root}/{INDEX}"))["weight_map"].values())):
        weights.update(read(shard))
    return weights


def from_hf_folder(path: str | Path, storage_options: dict | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our fp32 state dict) of a Hugging Face Llama folder, local or at an fsspec URL (an
    export of ours, or any Llama our decoder can express)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(path), **(storage_options or {}))
    if not fs.isfile(f"{root.rstrip('/')}/config.json"):
        raise HFError(f"{path}: no config.json (not a Hugging Face model folder)")
    cfg = model_config_from_hf(json.loads(fs.cat_file(f"{root.rstrip('/')}/config.json")))
    state: dict[str, torch.Tensor] = {}
    for name, t in read_weights(path, storage_options).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # older exports saved the derived RoPE table; ours is computed
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue  # a tied model's head is the embedding
        state[our_name(name)] = t.to(torch.float32)
    check_state_dict(state, cfg)
    return cfg, state
