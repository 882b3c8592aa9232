"""One member with a stolen key, within the rules: what it pushes cannot wreck the aggregate.

Each test plays the attacker with a client built from the .proto (diloco_pb2 stubs), beside honest islands that
push pseudo-gradients of one scale, and asserts the coordinator's refusal or bound.
"""

from __future__ import annotations

import torch

from conftest import claim, tiny_config, wait_for_round
from diloco.codec import Fp32Codec
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import PROTOCOL_VERSION, push_messages, tensor_chunks


def _join(stub, key: str) -> str:
    return stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_key=key), timeout=10).island_id


def _pg(shapes, seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}


def _push(stub, coordinator, island: str, round_: int, pg: dict, **header) -> pb.PushResponse:
    cfg = coordinator.state.cfg
    fields = dict(claim(cfg, cfg.inner.steps_per_round), global_checksum=coordinator.state.fragments[0].checksum)
    fields.update(header)
    message = pb.PushHeader(island_id=island, round=round_, codec="fp32", **fields)
    return stub.PushPseudoGradient(push_messages(message, tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)), timeout=30)


def test_a_push_placed_at_the_lr_peak_is_judged_where_its_round_sits(make_coordinator, channel_to):
    """The norm guard judges a norm per unit of the inner lr the round trained with. A push claiming its steps sat at
    the lr's peak (first_step) while its round is in warmup would pass 5x an honest norm as 0.9x: the coordinator
    places the round on the schedule itself."""
    cfg = tiny_config("rounds.rounds=20", "inner.warmup_steps=20", "rounds.min_islands=3")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b, attacker = (_join(stub, k) for k in "abc")
    shapes = coordinator.state.manifest.shapes
    for i, island in enumerate((a, b, attacker)):  # round 0, honest: the guard's history
        _push(stub, coordinator, island, 0, _pg(shapes, i))
    wait_for_round(coordinator, 0)
    _push(stub, coordinator, a, 1, _pg(shapes, 10))
    _push(stub, coordinator, b, 1, _pg(shapes, 11))
    # Round 1 trains at lr positions 2-3 of a 20-step warmup; positions 20-21 are the peak, 5.7x the lr.
    _push(stub, coordinator, attacker, 1, _pg(shapes, 12, scale=5e-3), first_step=20)
    wait_for_round(coordinator, 1)
    assert list(coordinator.state.summaries[-1].clipped) == [attacker]
