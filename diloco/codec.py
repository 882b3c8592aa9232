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
from collections.abc import Mapping
from typing import Protocol

import numba
import numpy as np
import torch
import zstandard

from diloco.config import ConfigError


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


# --- numba kernels ---------------------------------------------------------------------
# Written so LLVM vectorizes them: every loop runs over a per-block slice with a
# fixed trip count (indexing one long array between computed bounds defeats the
# vectorizer: 10x slower). The block absmax is an integer max over the float
# bits with the sign cleared (for non-negative floats bit order is value order),
# which also exposes NaN/Inf (bits >= 0x7F800000) with no extra pass. A block
# holding NaN/Inf gets a NaN scale, so the receiver sees it and refuses it.

_ABS = np.uint32(0x7FFFFFFF)
_NONFINITE = np.uint32(0x7F800000)
# e3m0: t = r * 4/3 has the exponent of the power of two nearest to r (r in
# [0.75 * 2**k, 1.5 * 2**k) <=> t in [2**k, 2**(k+1))); r < 2**-7 rounds to zero.
_E3M0_ZERO_BELOW = np.int32(np.float32(4.0 / 3.0 * 2.0**-7).view(np.int32))


@numba.njit(cache=True, nogil=True)
def _absmax_bits(bits):  # pragma: no cover - compiled
    m = np.uint32(0)
    for i in range(bits.shape[0]):
        v = bits[i] & _ABS
        m = v if v > m else m
    return m


@numba.njit(cache=True, nogil=True)
def _int8_encode(x, block, scales, q):  # pragma: no cover - compiled
    xu = x.view(np.uint32)
    word = np.empty(1, dtype=np.uint32)
    absmax = word.view(np.float32)
    for b in range(scales.shape[0]):
        xb, qb = x[b * block : (b + 1) * block], q[b * block : (b + 1) * block]
        word[0] = _absmax_bits(xu[b * block : (b + 1) * block])
        if word[0] >= _NONFINITE:
            scales[b] = np.float32(np.nan)
            qb[:] = 0
            continue
        m = absmax[0]
        scales[b] = m / np.float32(127.0)
        inv = np.float32(127.0) / m if m > 0 else np.float32(0.0)
        for i in range(xb.shape[0]):
            qb[i] = np.int8(np.rint(xb[i] * inv))


@numba.njit(cache=True, nogil=True)
def _int8_decode(q, scales, block, out):  # pragma: no cover - compiled
    for b in range(scales.shape[0]):
        s = scales[b]
        qb, ob = q[b * block : (b + 1) * block], out[b * block : (b + 1) * block]
        for i in range(qb.shape[0]):
            ob[i] = np.float32(qb[i]) * s


@numba.njit(cache=True, nogil=True)
def _e3m0_encode(x, block, scales, packed):  # pragma: no cover - compiled
    """Codes: bit 3 sign, bits 0-2 magnitude c (0: zero, else 2**(c - 7) of the block absmax); two per byte."""
    xu = x.view(np.uint32)
    word = np.empty(1, dtype=np.uint32)
    absmax = word.view(np.float32)
    t = np.empty(block, dtype=np.float32)
    ti = t.view(np.int32)
    codes = np.empty(block, dtype=np.uint8)
    for b in range(scales.shape[0]):
        xb, ub = x[b * block : (b + 1) * block], xu[b * block : (b + 1) * block]
        n = xb.shape[0]
        word[0] = _absmax_bits(ub)
        m = absmax[0]
        if word[0] >= _NONFINITE or m == 0:
            scales[b] = np.float32(np.nan) if word[0] >= _NONFINITE else np.float32(0.0)
            codes[:n] = 0
        else:
            scales[b] = m
            inv = np.float32(4.0 / 3.0) / m
            for j in range(n):
                t[j] = abs(xb[j]) * inv
            for j in range(n):
                c = min(max((ti[j] >> 23) - 120, 1), 7)  # exponent - 127 + 7, clamped to 1..7
                c = c if ti[j] >= _E3M0_ZERO_BELOW else 0
                sign = (ub[j] >> 28) & 8
                codes[j] = np.uint8(c | (sign if c > 0 else 0))
        pb = packed[b * (block // 2) : b * (block // 2) + (n + 1) // 2]
        for j in range(n // 2):
            pb[j] = codes[2 * j] | (codes[2 * j + 1] << 4)
        if n & 1:
            pb[n // 2] = codes[n - 1]


@numba.njit(cache=True, nogil=True)
def _e3m0_decode(packed, scales, block, out):  # pragma: no cover - compiled
    bits = np.empty(block, dtype=np.int32)
    values = bits.view(np.float32)
    for b in range(scales.shape[0]):
        s = scales[b]
        ob = out[b * block : (b + 1) * block]
        n = ob.shape[0]
        pb = packed[b * (block // 2) : b * (block // 2) + (n + 1) // 2]
        for j in range(pb.shape[0]):
            lo = np.int32(pb[j] & 15)
            hi = np.int32(pb[j] >> 4)
            # 2**(c - 7) as float bits: exponent c + 120, sign from bit 3; c = 0 is zero.
            e = lo & 7
            bits[2 * j] = (((e + 120) << 23) | ((lo & 8) << 28)) if e else 0
            e = hi & 7
            if 2 * j + 1 < block:
                bits[2 * j + 1] = (((e + 120) << 23) | ((hi & 8) << 28)) if e else 0
        for i in range(n):
            ob[i] = values[i] * s


@numba.njit(cache=True, nogil=True)
def _rice_encode(idx, top, out):  # pragma: no cover - compiled
    """Ascending positions per row -> Golomb-Rice codes of the gaps, each row byte-aligned: one byte r,
    then per position the gap's high part in unary (zeros, a one) and its r low bits, LSB first.
    r is the row's cheapest of top-3..top (_rice_bound_r); out must be zeroed and big enough.
    Returns the bytes written."""
    pos = 0
    k = idx.shape[1]
    for b in range(idx.shape[0]):
        row = idx[b]
        best_r, best_bits = 0, np.int64(1) << 62
        for r in range(max(0, top - 3), top + 1):  # the cheapest is near log2 of the mean gap, at most 3 below top
            bits = np.int64(k * (r + 1))
            prev = -1
            for i in range(k):
                bits += (row[i] - prev - 1) >> r
                prev = row[i]
            if bits < best_bits:
                best_r, best_bits = r, bits
        pos = (pos + 7) & ~7
        out[pos >> 3] = best_r
        pos += 8
        prev = -1
        for i in range(k):
            g = row[i] - prev - 1
            prev = row[i]
            pos += g >> best_r
            out[pos >> 3] |= np.uint8(1 << (pos & 7))
            pos += 1
            for j in range(best_r):
                if (g >> j) & 1:
                    out[pos >> 3] |= np.uint8(1 << (pos & 7))
                pos += 1
    return (pos + 7) >> 3


@numba.njit(cache=True, nogil=True)
def _rice_decode(buf, idx, length):  # pragma: no cover - compiled
    """Inverse of _rice_encode for rows of `length` elements; returns the bytes read, or -1 when the
    stream is short, r is out of range, or a position runs past the row."""
    nbits = buf.shape[0] * 8
    pos = 0
    k = idx.shape[1]
    for b in range(idx.shape[0]):
        pos = (pos + 7) & ~7
        if pos + 8 > nbits:
            return -1
        r = np.int64(buf[pos >> 3])
        pos += 8
        if r > 16:
            return -1
        prev = -1
        for i in range(k):
            q = 0
            while True:
                if pos >= nbits:
                    return -1
                bit = (buf[pos >> 3] >> (pos & 7)) & 1
                pos += 1
                if bit:
                    break
                q += 1
                if q > length:
                    return -1
            if pos + r > nbits:
                return -1
            g = q << r
            for j in range(r):
                g |= np.int64((buf[pos >> 3] >> (pos & 7)) & 1) << j
                pos += 1
            p = prev + 1 + g
            if p >= length:
                return -1
            idx[b, i] = p
            prev = p
    return (pos + 7) >> 3


@numba.njit(cache=True, nogil=True)
def _topk_fill(levels, codes, bits, idx, out):  # pragma: no cover - compiled
    """out[b] = 0 except at idx[b, i]: +-levels[b, code >> 1] (code bit 0: the sign), codes packed LSB first."""
    for b in range(idx.shape[0]):
        row, packed, lv = out[b], codes[b], levels[b]
        row[:] = 0
        pos = 0
        for i in range(idx.shape[1]):
            c = 0
            for j in range(bits):
                c |= ((packed[pos >> 3] >> (pos & 7)) & 1) << j
                pos += 1
            v = lv[c >> 1]
            row[idx[b, i]] = -v if c & 1 else v


def _rice_bound_r(length: int, k: int) -> int:
    """The r with (length - k) <= k * 2^r: at it, k gaps summing to at most length - k cost at most
    k * (r + 2) bits, so the encoder (which tries it) never needs more."""
    r = 0
    while length - k > k << r:
        r += 1
    return r


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


@torch.no_grad()
def subtract_residual_(local: Mapping[str, torch.Tensor], residuals: Mapping[str, torch.Tensor], scale: float) -> None:
    """local[name] -= scale * residuals[name], in place; local may be a subset of the names (a fragment
    or a shard's views) and may live on another device."""
    for name, p in local.items():
        p.sub_((residuals[name].view(p.shape) * scale).to(p.device, p.dtype))


class ErrorFeedback:
    """What a lossy codec failed to send, kept by the sender and added to the next round's message.

    Per element: e <- decay * e + x; send C(e); e <- e - D(C(e)). With decay 1
    this is classic error feedback (nothing is ever lost, only delayed);
    SparseLoCo decays it a little.

    in_model (CSER's "error reset"): the residual is not added to the next
    message; the island starts its next round from theta_global - decay * e
    instead, so the unsent part stays in its local parameters, keeps training
    there, and is measured again as part of the next pseudo-gradient. Classic
    error feedback instead re-measures the same displacement from a global point
    that did not move and sums the re-measurements, noise included.

    Buffers are flat per name and may hold a whole parameter or one rank's
    shard of it (offsets count within the buffer). encode() never consumes
    state: it writes the new residual to `pending`, which becomes the state
    (`buffers`) at commit(), once the contribution was delivered; so a push
    that is resent, or taken over by another replica group, encodes the same
    bytes. compress() is encode and commit in one (in-process use).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...] | int], decay: float = 1.0, in_model: bool = False):
        def numel(s) -> int:
            return int(s) if isinstance(s, int) else (int(np.prod(s)) if s else 1)

        self.buffers = {n: torch.zeros(numel(s), dtype=torch.float32) for n, s in shapes.items()}
        self.pending = {n: torch.zeros_like(t) for n, t in self.buffers.items()}
        self.decay = decay
        self.in_model = in_model

    def encode(self, name: str, offset: int, piece: torch.Tensor, codec: Codec) -> bytes:
        """The payload for elements [offset, offset + n) of name; their new residual goes to pending."""
        piece = piece.detach().to("cpu", torch.float32).reshape(-1)
        owed = self.buffers[name][offset : offset + piece.numel()]
        residual = piece.clone() if self.in_model else (owed * self.decay if self.decay != 1.0 else owed.clone()).add_(piece)
        payload = codec.encode(residual)
        self.pending[name][offset : offset + piece.numel()].copy_(residual.sub_(codec.decode(payload, residual.numel())))
        return payload

    def compress(self, name: str, offset: int, piece: torch.Tensor, codec: Codec) -> bytes:
        payload = self.encode(name, offset, piece, codec)
        n = piece.numel()
        self.buffers[name][offset : offset + n].copy_(self.pending[name][offset : offset + n])
        return payload

    def commit(self, names=None) -> None:
        """The encoded contribution was delivered: what it failed to send is now owed (of names, or all)."""
        for name in names if names is not None else self.buffers:
            self.buffers[name].copy_(self.pending[name])

    def reset(self) -> None:
        for t in self.buffers.values():
            t.zero_()

    def keep_residual_(self, local: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """local -= weight * decay * residual (in_model, after local was set from theta_global)."""
        subtract_residual_(local, self.buffers, weight * self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, t in state.items():
            if name not in self.buffers or self.buffers[name].shape != t.shape:
                raise ValueError(f"error-feedback state for {name} does not fit this model")
            self.buffers[name].copy_(t)
