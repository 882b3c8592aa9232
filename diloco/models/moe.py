"""Mixture-of-experts MLP: top-k token-choice routing with a capacity per expert, and its load-balancing loss.

A block's MLP becomes `model.moe_experts` SwiGLU experts of `model.d_ff` each and a router (one d_model x
n_experts matrix, no bias):

- Routing: probabilities p = softmax(router(x)) in fp32; each token picks the top-k experts by router
  logit, ties going to the lower expert index (a stable sort: torch.topk promises no order for ties).
  Its gates are the chosen probabilities renormalised to sum to 1 (Mixtral; softmax over the top-k
  logits is the same thing) when k > 1, and the raw probability (Switch Transformer) when k = 1, where
  a renormalised gate would be the constant 1 and the router would learn from the auxiliary loss alone.
- Capacity: every sequence is a routing group (GShard's groups) of T tokens, and each expert takes at
  most C = min(T, ceil(capacity_factor * T * k / n_experts)) of its tokens. Slots go in token order
  (token t's choices before token t + 1's), so whether a token is dropped depends only on the tokens
  before it: the model stays causal. A choice that finds its expert full is dropped: it adds nothing
  (the gates of the kept choices are not renormalised again, as GShard and Switch), and a token that
  loses every choice passes through the block's residual connection unchanged.
- Auxiliary loss (Switch Transformer eq. 4, with GShard's top-k counts): per group,
  n_experts * sum_i f_i * P_i, f_i the fraction of the group's T * k choices (before capacity) that
  picked expert i, P_i the mean router probability of expert i; averaged over groups. f is a count and
  carries no gradient; P does. Uniform routing gives exactly 1 for any k.

Groups are sequences so that routing, capacity and the auxiliary loss of a sequence do not depend on
which other sequences share its batch: a 1 x 2 FSDP island (half the batch per rank, gradients
averaged) computes what a one-rank island computes on the whole batch.

Every expert runs on a fixed (groups, C, d_model) buffer whatever the routing (empty slots are zero
rows), so every expert and the router get a gradient at every step, shapes never depend on the data,
and nothing branches on it in Python: FSDP2's reduce-scatter and torchft's all-reduce see every
parameter every step. Experts are separate 2-D matrices (a ModuleList of the dense model's MLP), not
one stacked 3-D tensor: each expert is its own linear map to Muon (diloco/models/muon.py takes 2-D
matrices) and keeps the dense MLP's parameter names and depth-scaled init.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco.sections import ModelConfig


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert in a group of `tokens` tokens; never more than the group has (a token picks an expert once)."""
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / n_experts)))


@dataclass
class Routing:
    """One forward's routing of G groups of T tokens to k of E experts."""

    probs: torch.Tensor  # (G, T, E) fp32 router probabilities
    experts: torch.Tensor  # (G, T, k) chosen experts, highest logit first
    gates: torch.Tensor  # (G, T, k) fp32 combine weights
    slot: torch.Tensor  # (G, T, k) each choice's position in its expert's buffer (>= capacity: dropped)
    kept: torch.Tensor  # (G, T, k) bool, slot < capacity
    capacity: int


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """Top-k token-choice routing of router logits (G, T, E) with a capacity per expert and group."""
    groups, tokens, n_experts = logits.shape
    logits = logits.float()
    probs = logits.softmax(-1)
    # Stable sort: equal logits go to the lower expert index, the same on CPU and CUDA.
    experts = logits.sort(dim=-1, descending=True, stable=True).indices[..., :top_k]
    chosen = probs.gather(-1, experts)
    gates = chosen / chosen.sum(-1, keepdim=True) if top_k > 1 else chosen
    onehot = F.one_hot(experts, n_experts)  # (G, T, k, E)
    # Slots in token order: an integer running count of each expert's choices over (t, j), flattened per group.
    taken = onehot.flatten(1, 2).cumsum(1).view_as(onehot)
    slot = (taken * onehot).sum(-1) - 1
    capacity = expert_capacity(tokens, n_experts, top_k, capacity_factor)
    return Routing(probs, experts, gates, slot, slot < capacity, capacity)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """n_experts * sum_i f_i * P_i per group (Switch Transformer), averaged over groups; 1 for uniform routing."""
    n_experts = probs.shape[-1]
    f = F.one_hot(experts, n_experts).to(probs.dtype).mean(dim=(1, 2))  # (G, E): share of the T * k choices
    p = probs.mean(1)  # (G, E)
    return (n_experts * (f * p).sum(-1)).mean()


class MoE(nn.Module):
    """n_experts experts built by make_expert and a router; forward(x) -> (y, auxiliary loss)."""

    def __init__(self, cfg: ModelConfig, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.top_k, self.capacity_factor = cfg.moe_top_k, cfg.moe_capacity_factor
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.moe_experts))

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(G, T, E) fp32 logits, computed in fp32 even under bf16 autocast or FSDP's bf16 parameters (Switch
        Transformer's selective precision): bf16 logits would tie often and round the softmax."""
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.router.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups, tokens, d = x.shape
        r = route(self.router_logits(x), self.top_k, self.capacity_factor)
        n_experts, capacity = len(self.experts), r.capacity
        # Flat buffer index of every choice, group-major: (g, e, slot). Dropped choices point one past the
        # end, at a zero row, so the combine below reads 0 for them without a branch.
        group = torch.arange(groups, device=x.device).view(groups, 1, 1)
        end = groups * n_experts * capacity
        dest = torch.where(r.kept, (group * n_experts + r.experts) * capacity + r.slot, end)
        # The token each slot holds; empty slots hold the zero row appended to x. Destinations are unique
        # except `end`, which collects the dropped choices and is cut off.
        token = torch.arange(groups * tokens, device=x.device).view(groups, tokens, 1).expand_as(dest)
        source = torch.full((end + 1,), groups * tokens, device=x.device, dtype=torch.long)
        source = source.scatter(0, dest.reshape(-1), token.reshape(-1))[:end]
        inputs = torch.cat([x.reshape(-1, d), x.new_zeros(1, d)])[source].view(groups, n_experts, capacity, d)
        outputs = torch.stack([expert(inputs[:, e]) for e, expert in enumerate(self.experts)], dim=1)
        outputs = torch.cat([outputs.reshape(-1, d), outputs.new_zeros(1, d)])
        picked = outputs[dest.reshape(-1)].view(groups, tokens, self.top_k, d)
        y = (picked.float() * r.gates.unsqueeze(-1)).sum(2)
        return y.to(x.dtype), load_balancing_loss(r.probs, r.experts)


def inactive_parameters(cfg: ModelConfig) -> int:
    """Parameters a token does not use: the (n_experts - k) experts it is not routed to, in every block."""
    if not cfg.moe_experts:
        return 0
    return cfg.n_layers * (cfg.moe_experts - cfg.moe_top_k) * 3 * cfg.d_model * cfg.d_ff
