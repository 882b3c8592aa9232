"""Helpers on named parameter sets: fp32 copies and checksums."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn
import xxhash


def fp32_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of a module's parameters, in module order."""
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()}


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """Content hash of a parameter set (names, shapes and fp32 bytes); order-independent.

    XXH3-128: it guards against drift and corruption, not an adversary, and it runs
    at ~15 GB/s on one core where blake2b ran at 0.75 (a 124M-parameter model is
    hashed several times a round). The fp32 buffer is hashed in place, never copied.
    """
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy())
    return h.hexdigest()


def module_checksum(model: nn.Module) -> str:
    return checksum(dict(model.named_parameters()))


def ranges_checksum(pieces: Iterable[tuple[str, int, torch.Tensor]]) -> str:
    """Content hash of flat ranges (name, offset, values) of a parameter set; order-independent.

    The coordinator computes it over the ranges a rank asked for, the rank over
    the shard it holds: both see only those elements, so a rank can verify its
    shard without the rest of the model. Hashes the fp32 buffer in place (no copy).
    """
    h = xxhash.xxh3_128()
    for name, offset, values in sorted(pieces, key=lambda p: (p[0], p[1])):
        t = values.detach().to("cpu", torch.float32).contiguous().view(-1)
        h.update(f"{name}@{offset}+{t.numel()};".encode())
        h.update(t.numpy())
    return h.hexdigest()
