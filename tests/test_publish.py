"""The coordinator's publication (coordinator/publish.py): a lossy update made on many threads is the one made on one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator.publish import Publication
from diloco.wire.codec import get_codec
from diloco.v1 import diloco_pb2 as pb

pytestmark = pytest.mark.unit


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


@pytest.mark.parametrize("codec", ["int8", "e3m0"])
@pytest.mark.parametrize("islands", [1, 3])
def test_dividing_stepping_and_publishing_span_by_span_is_the_mean_the_whole_step_then_the_publication(codec, islands):
    """The coordinator streams a lossy update while it is made (FragmentRounds.apply, step_and_publish): each chunk's
    span divided into the mean, stepped and published on the publication's threads. Over three rounds (the first
    allocates the momentum) this is bit for bit mean(), the whole outer step, then the publication: chunks and their
    order, published and outer parameters, momentum and checksum; the stream hands out the same chunks, then its
    trailer. Three islands with unequal tokens make the division real."""
    from coordinator.publish import DeltaStream, step_and_publish
    from diloco.config import OuterConfig
    from diloco.outer import OuterOptimizer, PseudoGradientAccumulator

    torch.manual_seed(1)
    shapes = {"embed": (300, 64), "blocks.0.w": (64, 64), "norm": (64,)}
    start = {n: torch.randn(s) for n, s in shapes.items()}
    runs = []
    for by_span in (False, True):
        outer_params = {n: t.clone() for n, t in start.items()}
        outer = OuterOptimizer(outer_params, OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
        publication = Publication(outer_params, get_codec(codec), 1024, ThreadPoolExecutor(3))
        accumulator = PseudoGradientAccumulator(shapes)
        rounds = []
        for round_ in range(3):
            accumulator.reset()
            for k in range(islands):
                g = torch.Generator().manual_seed(100 * round_ + k)
                accumulator.add(1000 + 300 * k, {n: torch.randn(s, generator=g) * 0.01 for n, s in shapes.items()})
            if by_span:
                stream = DeltaStream(round_ + 1, publication.checksum, 1, 1000)
                step_s, publish_s = step_and_publish(publication, accumulator, outer, stream)
                assert step_s >= 0 and publish_s >= 0
                stream.finish(publication.checksum, False)
                assert [c.SerializeToString() for c in stream] == [c.SerializeToString() for c in publication.delta_chunks]
                assert stream.trailer() == pb.ResultTrailer(checksum=publication.checksum)
            else:
                outer.step(accumulator.mean(), consume=False)  # torch's own step
                publication.publish()
            rounds.append(([c.SerializeToString() for c in publication.delta_chunks], publication.checksum,
                           {n: t.clone() for n, t in publication.params.items()}, {n: t.clone() for n, t in outer_params.items()},
                           [outer.optimizer.state[p]["momentum_buffer"].clone() for p in outer_params.values()]))
        assert len(publication.delta_chunks) > 8  # many spans, so the threads interleave
        runs.append(rounds)
    for whole, streamed in zip(*runs):
        assert whole[:2] == streamed[:2]
        for a, b in zip(whole[2:], streamed[2:]):
            for x, y in zip(a.values() if isinstance(a, dict) else a, b.values() if isinstance(b, dict) else b):
                assert torch.equal(x, y)


def test_a_pull_of_an_update_that_failed_half_way_is_refused_and_waits_for_none_of_it():
    """A publication that raised part-way fails its stream: a pull that took chunks of it is refused (STILL_OPEN:
    it pulls again), so an island never applies part of an update."""
    from coordinator.publish import DeltaStream
    from diloco.wire.refusal import Refused
    from diloco.wire.refusal import Reason

    stream = DeltaStream(3, "base", 1, 10)
    stream.extend([pb.TensorChunk(name="w", offset=0, numel=1, payload=b"x")])
    taken = iter(stream)
    assert next(taken).name == "w"
    stream.fail()
    with pytest.raises(Refused) as err:
        next(taken)
    assert err.value.refusal.reason == Reason.STILL_OPEN
