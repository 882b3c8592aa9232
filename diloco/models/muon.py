"""Muon as DiLoCo's inner optimizer (MuLoCo): Muon for the hidden matrices, AdamW for everything else.

`MuonAdamW` is one `torch.optim.Optimizer` made of two: `Muon` (torch's
`torch.optim.Muon`, also on FSDP2 shards) for every 2-D matrix that is neither
an embedding nor the output head, and `torch.optim.AdamW` for the embedding,
the head and the norm gains (Muon orthogonalizes a matrix's update, which suits
a linear map between hidden states, not a lookup table or the logits). The two
share their param_group dicts and their state dict with the outer object, so
everything that knows one optimizer works unchanged: the inner step sets each
group's lr, DCP's get/set_optimizer_state_dict, torchft healing
(islands/fsdp.py's optimizer_state_to_local) and the evidence digests.

Learning rate: torch's adjust_lr_fn "match_rms_adamw" (Moonlight, arXiv
2502.16982) scales each matrix's orthogonalized update by 0.2 * sqrt(max(A, B)),
which gives it AdamW's update RMS (about 0.2), so Muon can take AdamW's lr and
weight decay. The Muon group carries lr_scale = muon_lr / lr and the inner step
sets its lr to the scheduled lr times that: one warmup + cosine drives both.

Sharded (FSDP2) islands: a rank holds rows [r0, r1) of each matrix, but
Newton-Schulz needs the whole matrix. The momentum stays sharded (it is
elementwise); each step all-gathers one matrix's momentum-mixed update at a
time, orthogonalizes the whole of it on every rank of the group and keeps its
own rows, so every rank applies exactly the rows a one-rank island would
(test: tests/test_muon.py). Extra memory per rank: one matrix's fp32 update
gathered whole plus Newton-Schulz's bf16 temporaries, for one matrix at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
# Torch's own Newton-Schulz and lr adjustment, so the sharded step is torch.optim.Muon's arithmetic exactly.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from diloco.config import InnerConfig

# Modules whose 2-D weights stay with AdamW besides nn.Embedding: the output head under the names
# decoder-only models give it (an untied head is `lm_head` here).
HEAD_NAMES = frozenset({"head", "lm_head", "output", "unembed", "embed_out"})
ADJUST_LR = ("match_rms_adamw", "original")


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon, AdamW with weight decay, AdamW without): 2-D and not an embedding or head / other matrices / norm gains."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 2)[-2] if "." in name else ""
        if p.dim() == 2 and id(p) not in embeddings and owner not in HEAD_NAMES:
            muon.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return muon, decay, no_decay


def _row_offset(p: DTensor) -> int:
    """The first row of p that this rank holds (FSDP2 shards on dim 0)."""
    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]


class Muon(torch.optim.Muon):
    """torch.optim.Muon; on DTensor (FSDP2 Shard(0)) parameters, the same step on this rank's rows."""

    def __init__(self, params: Iterable, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.sharded = any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self.sharded:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            bufs: list[torch.Tensor] = []
            self._init_group(group, params, grads, bufs)
            for p, grad, buf in zip(params, grads, bufs):
                self._sharded_update(p, grad, buf, group)
        return loss

    @staticmethod
    def _sharded_update(p: DTensor, grad: DTensor, buf: DTensor, group: dict) -> None:
        # torch.optim._muon._single_tensor_muon line by line, elementwise work on the local rows.
        lr, momentum = float(group["lr"]), group["momentum"]
        g, b, w = grad.to_local(), buf.to_local(), p.to_local()
        b.lerp_(g, 1 - momentum)
        update = g.lerp(b, momentum) if group["nesterov"] else b
        # Only here does a rank hold a whole matrix: the update, gathered from the group's ranks.
        whole = DTensor.from_local(update, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride()).full_tensor()
        del update
        ortho = _zeropower_via_newtonschulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])
        del whole
        r0 = _row_offset(p)
        w.mul_(1 - lr * group["weight_decay"])
        w.add_(ortho[r0 : r0 + w.shape[0]], alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the hidden matrices and AdamW for the rest, as one optimizer (param_groups: Muon's, then AdamW's)."""

    def __init__(self, model: nn.Module, cfg: InnerConfig) -> None:
        matrices, decay, no_decay = split_parameters(model)
        muon_lr = cfg.muon_lr or cfg.lr
        self.muon = Muon(
            [{"params": matrices, "lr_scale": muon_lr / cfg.lr}], lr=muon_lr, weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum, nesterov=True, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr,
        )
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # foreach: as build_inner_optimizer's AdamW (one multi-tensor kernel; works on DTensors).
        self.adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=True)
        # The very group dicts of both: an lr set here (the inner step, DCP's zero-lr init step) is theirs.
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self._share()

    def _share(self) -> None:
        """Both optimizers read this object's groups and its state (their parameters are disjoint)."""
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # Optimizer.load_state_dict makes new group dicts and a new state: share those again.
        super().load_state_dict(state_dict)
        self._share()
