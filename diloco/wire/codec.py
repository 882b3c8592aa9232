"""Codecs turn a flat fp32 tensor into wire bytes and back.

A codec is stateless and works on one chunk at a time, so both sides encode and
decode while streaming, never holding a whole model. What a lossy codec fails to
send is kept by the sender in an ErrorFeedback buffer and sent in a later round.

Codecs (payload bytes per element, before zstd):
- fp32: lossless, 4.
- bf16: round-to-nearest-even bfloat16, 2.
- int8: blockwise absmax int8 (one fp32 scale per block), 1 + 4/block.
- e3m0: the 4-bit float of Streaming DiLoCo (sign, 3 exponent bits, no mantissa)
  scaled by the block's absmax, 0.5 + 4/block.
- topk: chunked top-k (SparseLoCo): in every block of topk_block elements keep
  the density largest magnitudes, as uint16 positions and 2-bit values (sign,
  and which of two per-block magnitude levels). Use with error feedback.
Any of them may be followed by zstd ("int8+zstd").

The hot loops are numba kernels: one pass over the data instead of the five or
six temporaries that the same arithmetic costs in torch (benchmarks/codecs.py
measures both).
"""

from __future__ import annotations

import sys
import threading
from typing import Protocol

import numpy as np
import torch
import zstandard

from diloco.config import ConfigError
from diloco.wire.kernels import (
    _all_finite,
    _e3m0_decode,
    _e3m0_encode,
    _e3m0_sumsq,
    _int8_decode,
    _int8_encode,
    _int8_sumsq,
    _sumsq,
)
from diloco.wire.topk import TopK


class Codec(Protocol):
    name: str
    lossless: bool

    def max_elements(self, chunk_bytes: int) -> int:
        """Elements per chunk so that an encoded chunk stays within chunk_bytes."""
        ...

    def encoded_size(self, numel: int) -> int:
        """Exact payload bytes for numel elements (an upper bound for entropy-coded codecs)."""
        ...

    def encode(self, flat: torch.Tensor) -> bytes: ...

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        """Returns a flat fp32 CPU tensor; raises ValueError on a malformed payload."""
        ...

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        """decode() written straight into out (flat, contiguous fp32 CPU): no intermediate tensor."""
        ...

    def finite(self, payload: bytes, numel: int) -> bool:
        """Whether every decoded value would be finite; raises ValueError on a malformed payload."""
        ...

    def decode_view(self, payload: bytes | memoryview, numel: int) -> torch.Tensor:
        """decode(), except that the values may share memory with a writable payload (fp32: no copy); use them
        before the payload changes."""
        ...

    def decode_add(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        """out += decode(payload) (out flat, contiguous fp32 CPU), the same bits as out.add_(decode(...)), without
        the decoded tensor: the publication, an island applying an update and a fold of unit weight add this way."""
        ...

    def sumsq(self, payload: bytes, numel: int) -> float:
        """The decoded values' sum of squares in fp64 (the norm guard's measure), not finite when a value is
        not: finite() and the norm in one pass. Raises ValueError on a malformed payload."""
        ...

    def decode_sumsq(self, payload: bytes, numel: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """decode() and sumsq() (its bits) with one decode: for a caller that reads the values as they arrive.
        out: a buffer of numel fp32 elements to decode into (a caller's, reused chunk after chunk)."""
        ...


class _Decoder:
    """decode() in terms of decode_into(); finite() by decoding."""

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        self.decode_into(payload, out)
        return out

    def finite(self, payload: bytes, numel: int) -> bool:
        return _all_finite(self.decode(payload, numel).numpy().view(np.uint32))

    def sumsq(self, payload: bytes, numel: int) -> float:
        return float(_sumsq(self.decode(payload, numel).numpy()))

    def decode_sumsq(self, payload: bytes, numel: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        values = self._decoded(payload, numel, out)
        return values, float(_sumsq(values.numpy()))

    def _decoded(self, payload: bytes, numel: int, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return self.decode(payload, numel)
        self.decode_into(payload, out)
        return out

    def decode_view(self, payload: bytes | memoryview, numel: int) -> torch.Tensor:
        return self.decode(payload, numel)

    def decode_add(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        out.add_(self.decode_view(payload, out.numel()))


def _as_f32_numpy(flat: torch.Tensor) -> np.ndarray:
    return flat.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()


def _check_size(codec: Codec, payload: bytes, numel: int) -> None:
    expected = codec.encoded_size(numel)
    if len(payload) != expected:
        raise ValueError(f"{codec.name} payload is {len(payload)} bytes, expected {expected} for {numel} elements")


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


# --- codecs ----------------------------------------------------------------------------


class Fp32Codec(_Decoder):
    """No compression: little-endian IEEE fp32."""

    name = "fp32"
    lossless = True

    def max_elements(self, chunk_bytes: int) -> int:
        return chunk_bytes // 4

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, flat: torch.Tensor) -> bytes:
        return _as_f32_numpy(flat).astype("<f4", copy=False).tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        _check_size(self, payload, out.numel())
        out.numpy()[:] = np.frombuffer(payload, dtype="<f4")

    def finite(self, payload: bytes, numel: int) -> bool:
        _check_size(self, payload, numel)
        return _all_finite(np.frombuffer(payload, dtype="<u4"))  # on the payload itself: no copy

    def sumsq(self, payload: bytes, numel: int) -> float:
        _check_size(self, payload, numel)
        return float(_sumsq(np.frombuffer(payload, dtype="<f4")))

    def decode_view(self, payload: bytes | memoryview, numel: int) -> torch.Tensor:
        if isinstance(payload, bytes) or sys.byteorder != "little":  # torch views only writable, native-order buffers
            return self.decode(payload, numel)
        _check_size(self, payload, numel)
        return torch.frombuffer(payload, dtype=torch.float32, count=numel) if numel else torch.empty(0)


class Bf16Codec(_Decoder):
    """bfloat16, round to nearest even (torch's conversion)."""

    name = "bf16"
    lossless = False

    def max_elements(self, chunk_bytes: int) -> int:
        return chunk_bytes // 2

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, flat: torch.Tensor) -> bytes:
        return flat.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        _check_size(self, payload, out.numel())
        bits = torch.frombuffer(bytearray(payload), dtype=torch.int16)
        out.copy_(bits.view(torch.bfloat16))


class _BlockScaledCodec(_Decoder):
    """Shared layout: [fp32 scale per block][codes]."""

    lossless = False
    bits = 8

    def __init__(self, block_size: int):
        if block_size < 2 or block_size % 2:
            raise ConfigError(f"wire.block_size must be an even number >= 2, got {block_size}")
        self.block = block_size

    def _code_bytes(self, numel: int) -> int:
        return (numel * self.bits + 7) // 8

    def encoded_size(self, numel: int) -> int:
        return 4 * _blocks(numel, self.block) + self._code_bytes(numel)

    def max_elements(self, chunk_bytes: int) -> int:
        # Whole blocks only, so a chunk boundary never splits a scale block.
        per_block = 4 + self._code_bytes(self.block)
        return max(1, chunk_bytes // per_block) * self.block

    def _split(self, payload: bytes, numel: int) -> tuple[np.ndarray, np.ndarray]:
        _check_size(self, payload, numel)
        raw = np.frombuffer(payload, dtype=np.uint8)
        n_blocks = _blocks(numel, self.block)
        return raw[: 4 * n_blocks].view("<f4"), raw[4 * n_blocks :]

    def finite(self, payload: bytes, numel: int) -> bool:
        # A value is a code (|code| <= max_code) times its block's scale, so the values are finite iff the
        # scales are and the largest one times max_code is (the encoder gives a block with NaN/Inf a NaN scale).
        scales, _ = self._split(payload, numel)
        if not _all_finite(scales.view("<u4")):
            return False
        with np.errstate(over="ignore"):
            return scales.size == 0 or bool(np.isfinite(np.abs(scales).max() * np.float32(self.max_code)))


class Int8Codec(_BlockScaledCodec):
    name = "int8"
    bits = 8
    max_code = 128

    def encode(self, flat: torch.Tensor) -> bytes:
        x = _as_f32_numpy(flat)
        out = np.empty(self.encoded_size(x.size), dtype=np.uint8)
        n_blocks = _blocks(x.size, self.block)
        _int8_encode(x, self.block, out[: 4 * n_blocks].view(np.float32), out[4 * n_blocks :].view(np.int8))
        return out.tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _int8_decode(codes.view(np.int8), scales, self.block, out.numpy(), False)

    def decode_add(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _int8_decode(codes.view(np.int8), scales, self.block, out.numpy(), True)

    def sumsq(self, payload: bytes, numel: int) -> float:
        scales, codes = self._split(payload, numel)
        return float(_int8_sumsq(codes.view(np.int8), scales, self.block))

    def decode_sumsq(self, payload: bytes, numel: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        return self._decoded(payload, numel, out), self.sumsq(payload, numel)  # its own sum, from the codes: no second decode


class E3M0Codec(_BlockScaledCodec):
    name = "e3m0"
    max_code = 1  # 2**(c - 7), c <= 7
    bits = 4

    def encode(self, flat: torch.Tensor) -> bytes:
        x = _as_f32_numpy(flat)
        out = np.empty(self.encoded_size(x.size), dtype=np.uint8)
        n_blocks = _blocks(x.size, self.block)
        _e3m0_encode(x, self.block, out[: 4 * n_blocks].view(np.float32), out[4 * n_blocks :])
        return out.tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _e3m0_decode(codes, scales, self.block, out.numpy(), False)

    def decode_add(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _e3m0_decode(codes, scales, self.block, out.numpy(), True)

    def sumsq(self, payload: bytes, numel: int) -> float:
        scales, codes = self._split(payload, numel)
        return float(_e3m0_sumsq(codes, scales, self.block, numel))

    def decode_sumsq(self, payload: bytes, numel: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        return self._decoded(payload, numel, out), self.sumsq(payload, numel)  # its own sum, from the codes: no second decode


class TopKCodec(_Decoder, TopK):
    """SparseLoCo's chunked top-k (diloco/wire/topk.py), with decode() and finite() as every codec has them."""


class ZstdCodec(_Decoder):
    """Any codec's payload, compressed with zstd."""

    def __init__(self, inner: Codec, level: int = 3):
        if not 1 <= level <= 22:
            raise ConfigError(f"wire.zstd_level must be in [1, 22], got {level}")
        self.inner, self.level = inner, level
        self.name = f"{inner.name}+zstd"
        self.lossless = inner.lossless
        # zstd contexts are not thread-safe; the coordinator decodes on many threads.
        self._local = threading.local()

    def _contexts(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        if not hasattr(self._local, "c"):
            self._local.c = zstandard.ZstdCompressor(level=self.level)
            self._local.d = zstandard.ZstdDecompressor()
        return self._local.c, self._local.d

    def max_elements(self, chunk_bytes: int) -> int:
        # zstd never grows a payload by more than a few hundred bytes per MB.
        return self.inner.max_elements(max(1024, chunk_bytes - (chunk_bytes >> 7) - 512))

    def encoded_size(self, numel: int) -> int:
        raw = self.inner.encoded_size(numel)
        return raw + (raw >> 7) + 512

    def encode(self, flat: torch.Tensor) -> bytes:
        return self._contexts()[0].compress(self.inner.encode(flat))

    def _decompress(self, payload: bytes | memoryview, numel: int) -> bytes:
        limit = self.inner.encoded_size(numel)
        try:
            # The frame header's size decides the allocation: refuse a lie before decompressing.
            if zstandard.frame_content_size(payload) > limit:
                raise ValueError(f"zstd frame claims more than the {limit} bytes {numel} elements encode to")
            raw = self._contexts()[1].decompress(payload, max_output_size=limit, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd: {e}") from e
        return raw

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        self.inner.decode_into(self._decompress(payload, out.numel()), out)

    def decode_add(self, payload: bytes | memoryview, out: torch.Tensor) -> None:
        self.inner.decode_add(self._decompress(payload, out.numel()), out)


CODECS = ("fp32", "bf16", "int8", "e3m0", "topk")


def get_codec(
    name: str,
    zstd: bool = False,
    block_size: int = 256,
    density: float = 0.02,
    topk_block: int = 4096,
    zstd_level: int = 3,
    topk_bits: int = 2,
) -> Codec:
    """A codec by name; "X+zstd" or zstd=True adds zstd after it."""
    base, _, suffix = name.partition("+")
    if suffix and suffix != "zstd":
        raise ConfigError(f"unknown codec suffix {suffix!r} in {name!r}; only '+zstd' is known")
    builders = {
        "fp32": Fp32Codec,
        "bf16": Bf16Codec,
        "int8": lambda: Int8Codec(block_size),
        "e3m0": lambda: E3M0Codec(block_size),
        "topk": lambda: TopKCodec(density, topk_block, topk_bits),
    }
    if base not in builders:
        raise ConfigError(f"unknown codec {base!r}; available: {', '.join(CODECS)} (each may end in '+zstd')")
    codec = builders[base]()
    return ZstdCodec(codec, zstd_level) if zstd or suffix else codec
