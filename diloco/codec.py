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

import threading
from typing import Protocol

import numpy as np
import torch
import zstandard

from diloco.config import ConfigError
from diloco.kernels import (
    _e3m0_decode,
    _e3m0_encode,
    _int8_decode,
    _int8_encode,
    _rice_bound_r,
    _rice_decode,
    _rice_encode,
    _topk_fill,
)


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


class _Decoder:
    """decode() in terms of decode_into()."""

    def decode(self, payload: bytes, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        self.decode_into(payload, out)
        return out


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


class Int8Codec(_BlockScaledCodec):
    name = "int8"
    bits = 8

    def encode(self, flat: torch.Tensor) -> bytes:
        x = _as_f32_numpy(flat)
        out = np.empty(self.encoded_size(x.size), dtype=np.uint8)
        n_blocks = _blocks(x.size, self.block)
        _int8_encode(x, self.block, out[: 4 * n_blocks].view(np.float32), out[4 * n_blocks :].view(np.int8))
        return out.tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _int8_decode(codes.view(np.int8), scales, self.block, out.numpy())


class E3M0Codec(_BlockScaledCodec):
    name = "e3m0"
    bits = 4

    def encode(self, flat: torch.Tensor) -> bytes:
        x = _as_f32_numpy(flat)
        out = np.empty(self.encoded_size(x.size), dtype=np.uint8)
        n_blocks = _blocks(x.size, self.block)
        _e3m0_encode(x, self.block, out[: 4 * n_blocks].view(np.float32), out[4 * n_blocks :])
        return out.tobytes()

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        scales, codes = self._split(payload, out.numel())
        _e3m0_decode(codes, scales, self.block, out.numpy())


class TopKCodec(_Decoder):
    """Chunked top-k with `bits`-bit values (2 by default, as SparseLoCo).

    Per block: k = density * length kept values, as L = 2^(bits-1) fp32
    magnitude levels and k codes of `bits` bits (bit 0: sign, the rest: the
    level), packed LSB first, in ascending position order. With two levels a
    value is at the upper one when its magnitude is at least the kept values'
    mean; with more, the kept values are split into L equal-count groups by
    magnitude. A level is its group's mean magnitude.

    Payload: every block's levels and codes (fixed size), then every block's
    positions as Golomb-Rice codes of the gaps between them, with the block's
    cheapest parameter. For positions spread like random ones that is within a
    few percent of their entropy (tests/test_codec.py holds it to 5%), where a
    zstd-compressed bitmap of 4096-element blocks stays well above it (zstd's
    per-frame tables on small inputs) and uint16s far above. The payload's length
    therefore varies: encoded_size is an upper bound.
    """

    lossless = False
    name = "topk"

    def __init__(self, density: float, block: int, bits: int = 2):
        if not 0 < density <= 1:
            raise ConfigError(f"wire.topk_density must be in (0, 1], got {density}")
        if not 4 <= block <= 65536:
            raise ConfigError(f"wire.topk_block must be in [4, 65536], got {block}")
        if not 2 <= bits <= 8:
            raise ConfigError(f"wire.topk_bits must be in [2, 8] (a sign bit and 1-7 level bits), got {bits}")
        self.density, self.block, self.bits = density, block, bits
        self.levels = 1 << (bits - 1)

    def _k(self, length: int) -> int:
        return max(1, min(length, round(self.density * length)))

    def _fixed_bytes(self, length: int) -> int:
        """A block's levels and codes."""
        return 4 * self.levels + (self._k(length) * self.bits + 7) // 8

    def _max_position_bytes(self, length: int) -> int:
        """At most k * (r + 2) bits of Rice codes (_rice_bound_r), and one byte for r."""
        k = self._k(length)
        if k == length:
            return 0  # every position is kept: nothing to say
        return 1 + (k * (_rice_bound_r(length, k) + 2) + 7) // 8

    def _groups(self, numel: int) -> list[tuple[int, int]]:
        """(blocks, length) of the full blocks and of the tail, in payload order."""
        full, tail = divmod(numel, self.block)
        return [(n, length) for n, length in ((full, self.block), (1 if tail else 0, tail)) if n]

    def encoded_size(self, numel: int) -> int:
        return sum(n * (self._fixed_bytes(length) + self._max_position_bytes(length)) for n, length in self._groups(numel))

    def max_elements(self, chunk_bytes: int) -> int:
        per_block = self._fixed_bytes(self.block) + self._max_position_bytes(self.block)
        return max(1, chunk_bytes // per_block) * self.block

    def _encode_rows(self, rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """rows: (blocks, length) -> (levels and codes of every block, their Rice-coded positions)."""
        n, k = rows.shape[0], self._k(rows.shape[1])
        _, idx = torch.topk(rows.abs(), k, dim=1, sorted=False)
        idx, _ = idx.sort(dim=1)
        vals = rows.gather(1, idx)
        mags = vals.abs()
        if self.levels == 2:
            upper = mags >= mags.mean(dim=1, keepdim=True)
            n_up = upper.sum(1, keepdim=True)
            hi = torch.where(upper, mags, 0).sum(1, keepdim=True) / n_up.clamp(min=1)
            lo = torch.where(upper, 0, mags).sum(1, keepdim=True) / (k - n_up).clamp(min=1)
            level, means = upper.long(), torch.cat([lo, hi], dim=1)
        else:
            level = mags.argsort(dim=1).argsort(dim=1) * self.levels // k  # equal-count groups by rank
            sums = torch.zeros(n, self.levels).scatter_add_(1, level, mags)
            means = sums / torch.zeros(n, self.levels).scatter_add_(1, level, torch.ones_like(mags)).clamp(min=1)
        # Poison every level of a block holding NaN/Inf so the receiver sees it.
        poison = (rows * 0).sum(1, keepdim=True)
        levels = (means + poison).numpy().astype("<f4")
        codes = (vals < 0).long() | (level << 1)
        bits = ((codes.unsqueeze(-1) >> torch.arange(self.bits)) & 1).to(torch.uint8).reshape(n, k * self.bits)
        packed = np.packbits(bits.numpy(), axis=1, bitorder="little")
        stream = np.zeros(n * self._max_position_bytes(rows.shape[1]), dtype=np.uint8)
        used = _rice_encode(idx.numpy(), _rice_bound_r(rows.shape[1], k), stream) if k < rows.shape[1] else 0
        return np.concatenate([levels.view(np.uint8), packed], axis=1).reshape(-1), stream[:used]

    def encode(self, flat: torch.Tensor) -> bytes:
        x = flat.detach().to("cpu", torch.float32).reshape(-1)
        fixed, positions, start = [], [], 0
        for n, length in self._groups(x.numel()):
            f, p = self._encode_rows(x[start : start + n * length].view(n, length))
            fixed.append(f)
            positions.append(p)
            start += n * length
        return b"".join(a.tobytes() for a in fixed + positions)

    def _decode_rows(self, fixed: np.ndarray, idx: np.ndarray, length: int, out: torch.Tensor) -> None:
        blocks = idx.shape[0]
        rows = fixed.reshape(blocks, self._fixed_bytes(length))
        start = 4 * self.levels
        levels = rows[:, :start].copy().view("<f4").astype(np.float32)
        _topk_fill(levels, rows[:, start:], self.bits, idx, out.numpy().reshape(blocks, length))

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        numel = out.numel()
        if len(payload) > self.encoded_size(numel):
            raise ValueError(f"topk payload is {len(payload)} bytes, more than {numel} elements encode to")
        raw = np.frombuffer(payload, dtype=np.uint8)
        groups = self._groups(numel)
        fixed_end = sum(n * self._fixed_bytes(length) for n, length in groups)
        if len(raw) < fixed_end:
            raise ValueError(f"topk payload is {len(raw)} bytes, shorter than the {fixed_end} its levels and codes need")
        f0 = p0 = e0 = 0  # offsets: levels and codes, positions, elements
        for n, length in groups:
            k = self._k(length)
            if k == length:
                idx, used = np.broadcast_to(np.arange(length), (n, length)), 0
            else:
                idx = np.empty((n, k), dtype=np.int64)
                used = _rice_decode(raw[fixed_end + p0 :], idx, length)
            if used < 0:
                raise ValueError(f"topk positions are malformed (short, or past the end of a {length}-element block)")
            size = n * self._fixed_bytes(length)
            self._decode_rows(raw[f0 : f0 + size], idx, length, out[e0 : e0 + n * length])
            f0, p0, e0 = f0 + size, p0 + used, e0 + n * length
        if fixed_end + p0 != len(raw):
            raise ValueError(f"topk payload has {len(raw) - fixed_end - p0} bytes after its positions")


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

    def decode_into(self, payload: bytes, out: torch.Tensor) -> None:
        numel = out.numel()
        limit = self.inner.encoded_size(numel)
        try:
            # The frame header's size decides the allocation: refuse a lie before decompressing.
            if zstandard.frame_content_size(payload) > limit:
                raise ValueError(f"zstd frame claims more than the {limit} bytes {numel} elements encode to")
            raw = self._contexts()[1].decompress(payload, max_output_size=limit, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise ValueError(f"zstd: {e}") from e
        self.inner.decode_into(raw, out)


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
