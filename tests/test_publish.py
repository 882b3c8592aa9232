"""The coordinator's publication (coordinator/publish.py): a lossy update made on many threads is the one made on one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.publish import Publication
from diloco.codec import get_codec


@pytest.mark.parametrize("codec", ["int8", "e3m0", "int8+zstd", "bf16"])
def test_a_lossy_publication_on_many_threads_is_bit_for_bit_the_one_on_one(codec):
    """Three rounds of outer parameters moving: every chunk's bytes, their order, the published parameters and
    their checksum equal whatever the number of threads (chunks small enough that each thread gets many)."""
    torch.manual_seed(0)
    shapes = {"embed": (300, 64), "blocks.0.w": (64, 64), "norm": (64,)}
    outer = {n: torch.randn(s) for n, s in shapes.items()}
    one = Publication(outer, get_codec(codec), 1024)
    many = Publication(outer, get_codec(codec), 1024, ThreadPoolExecutor(4))
    for round_ in range(3):
        for t in outer.values():
            t.add_(torch.randn_like(t) * 0.01)
        one.publish()
        many.publish()
        assert len(one.delta_chunks) > 8
        assert [c.SerializeToString() for c in many.delta_chunks] == [c.SerializeToString() for c in one.delta_chunks], round_
        assert many.checksum == one.checksum and many.delta_base == one.delta_base
        for n in shapes:
            assert torch.equal(many.params[n], one.params[n])
            assert not torch.equal(many.params[n], outer[n])  # lossy: the gap is the downlink's error feedback
