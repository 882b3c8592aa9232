"""The inner side of DiLoCo: the island's optimizer, its schedule and one training step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from diloco.config import InnerConfig
from diloco.data.sources import Batch
from diloco.models.muon import MuonAdamW


def build_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm gains are not decayed), plain SGD, or Muon + AdamW."""
    # foreach: one multi-tensor kernel per update instead of a Python loop over
    # parameters; torch only defaults to it on CUDA (on CPU it is ~35% of a small
    # model's step). It works on FSDP2's DTensors too.
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, foreach=True)
    if cfg.optimizer == "muon":
        return MuonAdamW(model, cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=True)


def compute_precision(device: torch.device | str):
    """bf16 autocast on CUDA (fp32 master weights and optimizer state); plain fp32 elsewhere.

    Forward and backward run in bf16 like FSDP2's MixedPrecisionPolicy does for
    sharded islands; the loss and the optimizer stay fp32.
    """
    device = torch.device(device)
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def inner_lr(step: int, total_steps: int, cfg: InnerConfig) -> float:
    """Learning rate at inner step `step`, counted across the whole run (never per round)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    lr: float,
    grad_clip: float,
    reduce_gradients: Callable[[nn.Module, float], float | None] | None = None,
    device: torch.device | str = "cpu",
    autocast: bool = True,
) -> float | None:
    """One inner step; returns its loss, or None when it must be redone (it did not commit).

    reduce_gradients(model, loss) averages the gradients across whoever trains
    together (replica groups) and returns the loss to record, or None when the
    step did not commit: the optimizer then does not step. autocast: bf16 on
    CUDA (off where FSDP's mixed precision does it already).
    """
    inputs, targets = (t.to(device, non_blocking=True) for t in batch)
    with compute_precision(device if autocast else "cpu"):
        _, loss = model(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    value = loss.item()
    if reduce_gradients is not None:
        value = reduce_gradients(model, value)
        if value is None:
            return None
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip, foreach=True)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group: muon_lr / lr (diloco/models/muon.py)
    optimizer.step()
    return value


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch], device: torch.device | str = "cpu") -> float:
    """Mean cross-entropy (nats/token) over fixed batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for inputs, targets in batches:
        with compute_precision(device):
            _, loss = model(inputs.to(device), targets.to(device))
        total += loss.float().item()
    model.train(was_training)
    return total / max(1, len(batches))
