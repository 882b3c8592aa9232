"""The e3m0 codec in torch ops, on whatever device its tensors live: the numba kernels' bytes, bit for bit.

An island on a GPU holds its pseudo-gradient and error feedback there. Encoding
there sends 0.5 + 4/block bytes an element over PCIe instead of the 4 of fp32,
and the CPU does no encoding. The arithmetic is the kernels'
(diloco/wire/kernels.py `_e3m0_encode`, `_e3m0_decode`), op for op in float32.
The block absmax is an integer max over the bits with the sign cleared, so a NaN
or an Inf shows as bits >= 0x7F800000. A block holding one gets a NaN scale and
zero codes; an all-zero block gets scale 0. t = |x| * (4/3 / absmax) has the
exponent of the power of two nearest to |x| / absmax. tests/test_tensor_codec.py
checks the bytes, the values and error feedback against the codec on CPU
tensors. benchmarks/codecs.py times it as the torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diloco.wire.kernels import _ABS, _E3M0_VALUES, _E3M0_ZERO_BELOW, _NONFINITE

_INV_NUMERATOR = 4.0 / 3.0  # rounded to float32 where it is used, as the kernel's np.float32(4.0 / 3.0)


def e3m0_encode(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (flat fp32, any device) as its block scales (fp32, one a block) and packed codes (uint8, two an element
    pair, the first in the low nibble), on x's device."""
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    bits = F.pad(x, (0, (-n) % block)).view(torch.int32).view(-1, block)
    magnitude = bits & int(_ABS)
    absmax_bits = magnitude.amax(dim=1, keepdim=True)
    absmax = absmax_bits.view(torch.float32)
    nonfinite = absmax_bits >= int(_NONFINITE)  # the block holds a NaN or an Inf: no codes (an all-zero block has none anyway)
    scales = torch.where(nonfinite, torch.full_like(absmax, float("nan")), absmax)
    inv = torch.full_like(absmax, _INV_NUMERATOR) / absmax
    t = (magnitude.view(torch.float32) * inv).view(torch.int32)
    c = ((t >> 23) - 120).clamp(1, 7)
    # A zero is code 0 by name: where the absmax is subnormal its inverse overflows and 0 * inf is a NaN whose
    # sign is the device's (negative on x86, so the kernel reads code 0; positive on CUDA).
    c = torch.where((t >= int(_E3M0_ZERO_BELOW)) & (magnitude != 0), c, torch.zeros_like(c))
    sign = (bits >> 28) & 8  # the sign bit as bit 3 (an arithmetic shift: bit 3 of the result is bit 31)
    codes = torch.where(nonfinite, torch.zeros_like(c), c | torch.where(c > 0, sign, torch.zeros_like(sign)))
    codes = codes.view(-1)[:n].to(torch.uint8)
    if n % 2:
        codes = F.pad(codes, (0, 1))
    return scales.view(-1), codes[0::2] | (codes[1::2] << 4)


def e3m0_decode(scales: torch.Tensor, packed: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """The values e3m0_encode's scales and codes stand for (fp32, on their device): 2**(c - 7) x the block's
    scale, signed by bit 3; code 0 is zero."""
    table = torch.from_numpy(_E3M0_VALUES).to(packed.device)
    codes = torch.stack([packed & 15, packed >> 4], dim=1).view(-1)[:numel].long()
    values = F.pad(table[codes], (0, (-numel) % block)).view(-1, block)
    return (values * scales.view(-1, 1)).view(-1)[:numel]


def to_payload(scales: torch.Tensor, packed: torch.Tensor) -> bytes:
    """The wire payload of E3M0Codec: the scales (little-endian fp32), then the codes."""
    return scales.cpu().numpy().astype("<f4").tobytes() + packed.cpu().numpy().tobytes()


def from_payload(payload: bytes, numel: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """to_payload's inverse, on CPU."""
    blocks = -(-numel // block)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw[: 4 * blocks].view(torch.float32), raw[4 * blocks :]
