"""A Llama-style decoder: pre-norm RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP (or, with
model.moe_experts, a mixture of SwiGLU experts: diloco/models/moe.py).

Read top to bottom: rope, Attention, MLP, Block, Transformer. Inside a block the parameter names are
Hugging Face Llama's (q_proj ... down_proj) and rotary embeddings use its rotate-half convention (the
two halves of each head, not interleaved pairs), so diloco/models/hf.py maps a state dict to
LlamaForCausalLM's by renaming prefixes, with no permutation of q or k.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from diloco.config import ModelConfig
from diloco.models.moe import MoE, inactive_parameters


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2) for rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[..., i], x[..., i + d/2]) of x: (batch, heads, seq, head_dim), as HF's rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        # Separate q/k/v matrices (not one fused qkv): with grouped-query attention they differ in
        # shape, and each is a matrix of its own for the optimizer and for the HF mapping.
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head h reads key/value head h // (n_heads // n_kv_heads), as HF's repeat_kv; SDPA does
        # it without materialising the repeated keys and values.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (Shazeer, 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MoE(cfg, lambda: MLP(cfg)) if cfg.moe_experts else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output and its experts' load-balancing loss (None for a dense MLP)."""
        x = x + self.attn(self.attn_norm(x), cos, sin)
        if isinstance(self.mlp, MLP):
            return x + self.mlp(self.mlp_norm(x)), None
        y, aux = self.mlp(self.mlp_norm(x))
        return x + y, aux


def init_parameter_(name: str, p: torch.Tensor, cfg: ModelConfig) -> None:
    """The model's initialisation of one parameter (after every module's own: Transformer.reset_parameters)."""
    std = cfg.init_std
    if p.dim() < 2:
        nn.init.ones_(p)  # RMSNorm gains
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        # GPT-2 style: the projections into the residual stream are scaled by depth, so that
        # the stream's variance at init does not grow with the number of blocks.
        nn.init.normal_(p, std=std / math.sqrt(2 * cfg.n_layers))
    else:
        nn.init.normal_(p, std=std)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        # Tied: the output projection is the embedding matrix, and there is no lm_head parameter.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # RoPE tables are derived, not learned: keep them out of the state dict.
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The last forward's load-balancing loss (mixture of experts only), detached: train_step's loss
        # includes moe_aux_loss_coef times it, so loss - coef * aux_loss is the cross-entropy.
        self.aux_loss: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            init_parameter_(name, p, self.cfg)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens)
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        aux = []
        for block in self.blocks:
            x, block_aux = block(x, cos, sin)
            if block_aux is not None:
                aux.append(block_aux)
        x = self.norm(x)
        logits = F.linear(x, self.embed.weight) if self.lm_head is None else self.lm_head(x)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        if aux:
            # The mean over blocks, so the coefficient means the same at any depth. Training only: an
            # eval loss is the cross-entropy, comparable with a dense model's.
            aux_loss = torch.stack(aux).mean()
            self.aux_loss = aux_loss.detach()
            if self.training:
                loss = loss + self.cfg.moe_aux_loss_coef * aux_loss
        return logits, loss

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def active_parameters(self) -> int:
        """Parameters a token uses: all of a dense model's; a mixture of experts' less the experts it skips."""
        return self.num_parameters() - inactive_parameters(self.cfg)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (6N plus attention), as in the PaLM appendix.

        N counts the matrices that multiply: a tied embedding once (it is the output projection), an
        untied input embedding not at all (it is a lookup), and of a mixture of experts only the router
        and the top-k experts a token is routed to.
        """
        n = self.active_parameters() - (0 if self.lm_head is None else self.embed.weight.numel())
        attn = 12 * self.cfg.n_layers * self.cfg.d_model * seq_len
        return 6 * n + attn


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, in the model's order, without allocating one."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in Transformer(cfg).named_parameters()}


@torch.no_grad()
def initial_parameters(cfg: ModelConfig, seed: int, keep: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """The model's parameters as Transformer(cfg) after torch.manual_seed(seed) makes them, fp32, only those keep
    names (a coordinator shard's part), made one at a time: the peak is what is kept plus the largest parameter,
    never the whole model. Replays the construction's random draws in order (every module's own initialisation,
    then reset_parameters'), materialising each parameter only while it is drawn."""
    with torch.device("meta"):
        model = Transformer(cfg)  # shapes only; meta tensors draw nothing from the generator
    torch.manual_seed(seed)
    for module in model.modules():  # construction order: each module's own initialisation draws in this order
        if next(module.parameters(recurse=False), None) is not None and hasattr(module, "reset_parameters"):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()
            module.to_empty(device="meta", recurse=False)
    out = {}
    for name, p in model.named_parameters():
        real = torch.empty(p.shape, dtype=p.dtype)
        init_parameter_(name, real, cfg)
        if keep(name):
            out[name] = real.to(torch.float32)
    return out
