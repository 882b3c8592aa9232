"""One replica group's model, sharded with FSDP2, and what a rank holds of it.

Each transformer Block is its own FSDP unit, then the root (embedding, final
norm, and lm_head when the embedding is untied). A rank's shard of a parameter
is a DTensor whose local tensor is a contiguous Shard(0) slice: rows [r0, r1)
of the full parameter, so flat elements [r0 * row, r1 * row). FSDP2 pads
uneven shards in its own storage; the local view excludes the padding.

The model is built on the meta device and only the local shards are ever
allocated, so no rank materialises the full model, not even at start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from diloco.config import ModelConfig
from diloco.models.llama import Transformer, rope_tables
from diloco.wire.messages import FlatRange

log = logging.getLogger(__name__)


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU.

    The sharded parameters stay fp32 either way (they are the master weights the
    pseudo-gradient is computed from).
    """
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def build_sharded_model(cfg: ModelConfig, device: torch.device, world_size: int) -> tuple[Transformer, DeviceMesh]:
    """The transformer sharded over this replica group's ranks; parameter values are uninitialised."""
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    with torch.device("meta"):
        model = Transformer(cfg)
    policy = mixed_precision(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    # The root holds embed.weight, which a tied output projection reuses: one
    # parameter in one FSDP group, unsharded for the whole forward (an untied lm_head is the root's too).
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta, device=device)
    model.rope_cos, model.rope_sin = cos, sin
    return model, mesh


def build_island_model(cfg: ModelConfig, device: torch.device, world_size: int, compile_model: bool = False) -> Transformer:
    """The island rank's model: sharded with FSDP2 over the replica group's ranks, or whole on a one-rank island.

    Built on the meta device either way: parameter values come from the
    coordinator, so nothing is initialised only to be overwritten.
    """
    if world_size > 1:
        if compile_model:
            raise ValueError("--compile is for one-rank islands for now; drop it for --nproc-per-node/--replica-groups islands")
        return build_sharded_model(cfg, device, world_size)[0]
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    cos, sin = rope_tables(cfg.max_seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta, device=device)
    model.rope_cos, model.rope_sin = cos, sin
    if compile_model:
        # In place (nn.Module.compile): parameter names, and so the manifest and checkpoints, stay as they are.
        model.compile()
    return model


def local_flat(p: torch.Tensor) -> torch.Tensor:
    """The rank's shard of parameter (or gradient) p as a flat view (writes go to the parameter).

    Detached: to_local() is an autograd Function, and its views must not see
    in-place writes under autograd (the adoption of theta_global is one).
    """
    local = (p.to_local() if isinstance(p, DTensor) else p).detach()
    if not local.is_contiguous():
        raise RuntimeError("FSDP2 local shard is not contiguous; this layout is not supported")
    return local.view(-1)


def shard_range(name: str, p: torch.Tensor) -> FlatRange:
    """The flat range of the full parameter that this rank's shard of p holds."""
    if not isinstance(p, DTensor):
        return FlatRange(name, 0, p.numel())
    if len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise RuntimeError(f"{name}: expected FSDP2 Shard(0) placement, got {p.placements}; other layouts are not supported")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = 1
    for d in p.shape[1:]:
        row *= d
    numel = 1
    for d in shape:
        numel *= d
    if numel != p.to_local().numel():
        raise RuntimeError(f"{name}: local shard has {p.to_local().numel()} elements, expected {numel}")
    return FlatRange(name, offset[0] * row if numel else 0, numel)


@dataclass
class ShardLayout:
    """What this rank holds: one flat range per parameter (possibly empty), in manifest order."""

    ranges: list[FlatRange]

    @staticmethod
    def of(model: nn.Module) -> "ShardLayout":
        return ShardLayout([shard_range(n, p) for n, p in model.named_parameters()])

    @property
    def bases(self) -> dict[str, int]:
        return {r.name: r.offset for r in self.ranges}

    def numel(self) -> int:
        return sum(r.numel for r in self.ranges)

    def zeros(self) -> dict[str, torch.Tensor]:
        """fp32 CPU buffers shaped like the shard (theta_global's copy on this rank)."""
        return {r.name: torch.zeros(r.numel, dtype=torch.float32) for r in self.ranges}


def local_views(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local_flat(p) for n, p in model.named_parameters()}


def local_grads(model: nn.Module) -> Iterator[torch.Tensor]:
    """The flat local gradient shards, in parameter order (zeros where a parameter got none)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        yield local_flat(p.grad)


def optimizer_state_to_local(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state dict with every DTensor replaced by its local shard (for healing)."""
    sd = optimizer.state_dict()
    state = {
        idx: {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in entries.items()}
        for idx, entries in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def optimizer_state_from_local(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Loads a state dict made by optimizer_state_to_local on a peer with the same layout."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for idx, entries in sd["state"].items():
        p = params[int(idx)]
        state[idx] = {
            k: (
                DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0
                else v
            )
            for k, v in entries.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
