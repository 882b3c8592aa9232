"""Helpers on named parameter sets: fp32 copies and checksums."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn as nn
import xxhash


def fp32_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached fp32 CPU copies of a module's parameters, in module order."""
    return {n: p.detach().to("cpu", torch.float32).clone() for n, p in model.named_parameters()}


@torch.no_grad()
def load_parameters(model: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copies params into the model's parameters of the same names (others stay), reading them one at a time in the
    model's order: a mapping that hands back a file-backed tensor's pages when the next is read
    (coordinator/filebacked.py HandingBack) then holds one tensor resident, which load_state_dict, copying the
    mapping whole first, would not."""
    for name, p in model.named_parameters():
        if name in params:
            p.copy_(params[name])


def _hash_fp32(h: "xxhash.xxh3_128", header: str, t: torch.Tensor) -> None:
    """Feeds header, then the tensor's fp32 bytes (hashed in place when already fp32 on the CPU)."""
    h.update(header.encode())
    h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())


CHECKSUM_SLICE = 1 << 22  # elements checksum hashes at a time when it hands pages back: 16 MiB of fp32


def checksum(tensors: Mapping[str, torch.Tensor], after: Callable[[str, int, int], None] | None = None) -> str:
    """Content hash of a parameter set (names, shapes and fp32 bytes); order-independent.

    XXH3-128: it guards against drift and corruption, not an adversary, and is many
    times faster than a cryptographic hash (a 124M-parameter model is hashed several
    times a round). With after (fp32 CPU tensors): the same digest (XXH3 is streamed),
    hashed CHECKSUM_SLICE elements at a time, after(name, lo, hi) called once elements
    [lo, hi) of name were read: a file-backed copy hands their pages back
    (coordinator/filebacked.py), so no more than a slice of it is resident at once.
    """
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        header = name + str(tuple(t.shape))
        if after is None:
            _hash_fp32(h, header, t)
            continue
        h.update(header.encode())
        flat = t.detach().reshape(-1)
        for lo in range(0, flat.numel(), CHECKSUM_SLICE):
            hi = min(lo + CHECKSUM_SLICE, flat.numel())
            h.update(flat[lo:hi].numpy())
            after(name, lo, hi)
    return h.hexdigest()


def ranges_checksum(pieces: Iterable[tuple[str, int, torch.Tensor]]) -> str:
    """Content hash of flat ranges (name, offset, values) of a parameter set; order-independent.

    The coordinator computes it over the ranges a rank asked for, the rank over
    the shard it holds: both see only those elements, so a rank can verify its
    shard without the rest of the model.
    """
    h = xxhash.xxh3_128()
    for name, offset, values in sorted(pieces, key=lambda p: (p[0], p[1])):
        _hash_fp32(h, f"{name}@{offset}+{values.numel()};", values.reshape(-1))
    return h.hexdigest()
