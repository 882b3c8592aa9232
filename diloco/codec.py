"""Codecs turn a flat fp32 tensor into wire bytes and back.

A codec is stateless and works on one chunk at a time, so both sides can
encode and decode while streaming without holding a whole model.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from diloco.config import ConfigError


class Codec(Protocol):
    name: str

    def max_elements(self, chunk_bytes: int) -> int:
        """Elements per chunk so that an encoded chunk stays within chunk_bytes."""
        ...

    def encode(self, flat: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Returns a flat fp32 CPU tensor; raises ValueError on a malformed payload."""
        ...


class Fp32Codec:
    """No compression: little-endian IEEE fp32."""

    name = "fp32"

    def max_elements(self, chunk_bytes: int) -> int:
        return chunk_bytes // 4

    def encode(self, flat: torch.Tensor) -> bytes:
        return flat.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        if len(payload) != 4 * numel:
            raise ValueError(f"fp32 payload is {len(payload)} bytes, expected {4 * numel} for {numel} elements")
        return torch.from_numpy(np.frombuffer(payload, dtype="<f4").astype(np.float32))


_CODECS: dict[str, type] = {"fp32": Fp32Codec}


def get_codec(name: str) -> Codec:
    try:
        return _CODECS[name]()
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; available: {sorted(_CODECS)}") from None
