"""The codecs' numba kernels: block-scaled int8 and e3m0, and Golomb-Rice coded top-k positions.

One-pass kernels that release the GIL (nogil), so encoding on gRPC's threads and
training go on side by side; diloco/wire/codec.py wraps them as codecs.
"""

from __future__ import annotations

import numba
import numpy as np

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
def _sumsq(x):  # pragma: no cover - compiled
    """The sum of squares of float32 values in fp64, in a fixed order (eight running sums, then a fixed tree):
    the same bits on every machine. NaN or inf when a value is not finite."""
    acc = np.zeros(8, dtype=np.float64)
    whole = x.shape[0] - x.shape[0] % 8
    for i in range(0, whole, 8):
        for j in range(8):
            v = np.float64(x[i + j])
            acc[j] += v * v
    tail = 0.0
    for i in range(whole, x.shape[0]):
        v = np.float64(x[i])
        tail += v * v
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail


def _all_finite(bits: np.ndarray) -> bool:
    """Whether the float32 values whose bits these are (uint32) are all finite: one pass, no copy."""
    return bits.size == 0 or bool(_absmax_bits(bits) < _NONFINITE)


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
def _int8_decode(q, scales, block, out, add):  # pragma: no cover - compiled
    """out = the values, or with add out += them: each value rounded to fp32 and stored first, then added, so no
    fused multiply-add rounds once where decoding and then adding rounds twice (the same bits as out.add_(decoded))."""
    values = np.empty(block, dtype=np.float32)
    for b in range(scales.shape[0]):
        s = scales[b]
        qb, ob = q[b * block : (b + 1) * block], out[b * block : (b + 1) * block]
        n = qb.shape[0]
        if add:
            for i in range(n):
                values[i] = np.float32(qb[i]) * s
            for i in range(n):
                ob[i] += values[i]
        else:
            for i in range(n):
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


def _e3m0_values() -> np.ndarray:
    """The 16 codes' values before scaling: 2**(c - 7) with bit 3 the sign; c = 0 is zero (of either sign)."""
    c = np.arange(16, dtype=np.int32)
    e = c & 7
    return np.where(e > 0, ((e + 120) << 23) | ((c & 8) << 28), 0).astype(np.int32).view(np.float32)


_E3M0_VALUES = _e3m0_values()


@numba.njit(cache=True, nogil=True)
def _e3m0_unpack(pb, bits, block):  # pragma: no cover - compiled
    """A block's codes as the float bits of 2**(c - 7) (exponent c + 120, sign from bit 3; c = 0 is zero)."""
    for j in range(pb.shape[0]):
        lo = np.int32(pb[j] & 15)
        hi = np.int32(pb[j] >> 4)
        e = lo & 7
        bits[2 * j] = (((e + 120) << 23) | ((lo & 8) << 28)) if e else 0
        e = hi & 7
        if 2 * j + 1 < block:
            bits[2 * j + 1] = (((e + 120) << 23) | ((hi & 8) << 28)) if e else 0


@numba.njit(cache=True, nogil=True)
def _e3m0_decode(packed, scales, block, out, add):  # pragma: no cover - compiled
    """out = the values, or with add out += them (as _int8_decode: each value rounded and stored, then added)."""
    bits = np.empty(block, dtype=np.int32)
    values = bits.view(np.float32)
    for b in range(scales.shape[0]):
        s = scales[b]
        ob = out[b * block : (b + 1) * block]
        n = ob.shape[0]
        _e3m0_unpack(packed[b * (block // 2) : b * (block // 2) + (n + 1) // 2], bits, block)
        if add:
            for i in range(n):
                values[i] = values[i] * s
            for i in range(n):
                ob[i] += values[i]
        else:
            for i in range(n):
                ob[i] = values[i] * s


@numba.njit(cache=True, nogil=True)
def _e3m0_sumsq(packed, scales, block, numel):  # pragma: no cover - compiled
    """_sumsq of what _e3m0_decode would write, without writing it."""
    table = np.empty(16, dtype=np.float64)
    acc = np.zeros(8, dtype=np.float64)
    for b in range(scales.shape[0]):
        for k in range(16):
            v = np.float64(_E3M0_VALUES[k] * scales[b])
            table[k] = v * v
        n = min(block, numel - b * block)
        pb = packed[b * (block // 2) : b * (block // 2) + (n + 1) // 2]
        for j in range(n // 2):
            acc[j & 7] += table[pb[j] & 15] + table[pb[j] >> 4]
        if n & 1:
            acc[0] += table[pb[n // 2] & 15]
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


@numba.njit(cache=True, nogil=True)
def _int8_sumsq(q, scales, block):  # pragma: no cover - compiled
    """_sumsq of what _int8_decode would write, without writing it."""
    acc = np.zeros(8, dtype=np.float64)
    for b in range(scales.shape[0]):
        s = scales[b]
        qb = q[b * block : (b + 1) * block]
        for i in range(qb.shape[0]):
            v = np.float64(np.float32(qb[i]) * s)
            acc[i & 7] += v * v
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


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




# --- CountSketch (the norm guard's direction check, diloco/robust.py) ------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)


@numba.njit(cache=True, nogil=True)
def _count_sketch(x, first, key, out):  # pragma: no cover - compiled
    """Adds float32 values x, at positions first.. of one tensor whose hash key is `key`, into out (fp64, 2**14
    long): position p goes to the bucket of h's top 14 bits with the sign of its bit 40, h a multiply-xorshift
    hash of p ^ key. Linear, so a tensor sketched chunk by chunk in any split gives the same buckets. Branch-free
    (a random sign as a branch costs 3x)."""
    shift, s29, s40, one = np.uint64(64 - 14), np.uint64(29), np.uint64(40), np.uint64(1)
    base = np.uint64(first)
    for k in range(x.shape[0]):
        h = ((base + np.uint64(k)) ^ key) * _GOLDEN
        h = (h ^ (h >> s29)) * _MIX1
        sign = np.float64(np.int64((h >> s40) & one) * 2 - 1)
        out[np.int64(h >> shift)] += sign * x[k]
