"""The top-k encoding of SparseLoCo: per block, the largest magnitudes as positions and a few levels.

diloco/wire/codec.py makes it a codec (TopKCodec)."""

from __future__ import annotations

import numpy as np
import torch

from diloco.config import ConfigError
from diloco.wire.kernels import _rice_bound_r, _rice_decode, _rice_encode, _topk_fill


class TopK:
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
