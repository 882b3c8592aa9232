"""The e3m0 codec in torch ops (diloco/wire/tensor_codec.py), what a GPU island will encode with, against the
numba kernels on CPU tensors: the same bytes, the same values, the same error feedback."""

from __future__ import annotations

import pytest
import torch

from diloco.wire.codec import E3M0Codec
from diloco.wire.feedback import ErrorFeedback
from diloco.wire.tensor_codec import (
    e3m0_decode,
    e3m0_encode,
    from_payload,
    to_payload,
)

pytestmark = pytest.mark.unit

BLOCK = 256


def awkward(n: int, seed: int) -> torch.Tensor:
    """Normal values over several decades, and blocks that are all zeros, hold a NaN or an Inf, hold subnormals
    only, or values on the codes' rounding boundaries (0.75 x 2**k of the absmax)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    blocks = n // BLOCK
    if blocks >= 6:
        x[0:BLOCK] = 0.0
        x[BLOCK + 7] = float("nan")
        x[2 * BLOCK + 3] = float("-inf")
        x[3 * BLOCK : 4 * BLOCK] = torch.randn(BLOCK, generator=g) * 1e-41  # subnormal: the absmax's inverse overflows
        x[3 * BLOCK + 5] = 0.0
        boundary = x[4 * BLOCK : 5 * BLOCK]
        boundary[0] = 1.0
        boundary[1:17] = torch.tensor([0.75 * 2.0**-k for k in range(16)]) * torch.where(torch.arange(16) % 2 == 0, 1.0, -1.0)
        x[5 * BLOCK + 1] = -0.0
    return x


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (so -0.0 is not 0.0), NaN where the other has NaN (a NaN's payload aside)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


@pytest.mark.parametrize("n", [1, 2, 7, BLOCK - 1, BLOCK, BLOCK + 1, 6 * BLOCK + 3, 40 * BLOCK + 129])
def test_the_same_bytes_and_values_as_the_numba_kernels(n):
    codec = E3M0Codec(BLOCK)
    x = awkward(n, seed=n)
    scales, packed = e3m0_encode(x, BLOCK)
    payload = codec.encode(x)
    assert to_payload(scales, packed) == payload
    assert same_values(e3m0_decode(scales, packed, n, BLOCK), codec.decode(payload, n))
    assert same_values(e3m0_decode(*from_payload(payload, n, BLOCK), n, BLOCK), codec.decode(payload, n))


def test_nan_and_inf_blocks_decode_to_nan_as_the_kernels_do():
    codec = E3M0Codec(BLOCK)
    x = awkward(6 * BLOCK, seed=1)
    scales, packed = e3m0_encode(x, BLOCK)
    ours, theirs = e3m0_decode(scales, packed, x.numel(), BLOCK), codec.decode(codec.encode(x), x.numel())
    assert torch.isnan(scales[1]) and torch.isnan(scales[2]) and scales[0] == 0
    assert torch.isnan(ours[BLOCK : 3 * BLOCK]).all() and same_values(ours, theirs)


def test_error_feedback_over_rounds_matches_the_islands_own():
    """Three rounds of one parameter's pieces through ErrorFeedback (the codec on CPU) and through the torch ops:
    the same payloads and the same residual owed after each, so the feedback can stay on the GPU."""
    codec, n = E3M0Codec(BLOCK), 10 * BLOCK + 77
    feedback = ErrorFeedback({"w": n})
    owed = torch.zeros(n)
    for round_ in range(3):
        piece = torch.randn(n, generator=torch.Generator().manual_seed(round_)) * 1e-3
        payload = feedback.compress("w", 0, piece, codec)
        residual = owed + piece  # ErrorFeedback.encode's arithmetic with decay 1, in the torch ops
        scales, packed = e3m0_encode(residual, BLOCK)
        owed = residual - e3m0_decode(scales, packed, n, BLOCK)
        assert to_payload(scales, packed) == payload, f"round {round_}"
        assert same_values(owed, feedback.buffers["w"]), f"round {round_}"
    assert owed.abs().max() > 0  # a lossy codec owes something: the comparison above compared residuals
