"""One member with a stolen key, within the rules: what it pushes cannot wreck the aggregate.

Each test plays the attacker with a client built from the .proto (diloco_pb2 stubs), beside honest islands that
push pseudo-gradients of one scale, and asserts the coordinator's refusal or bound.
"""

from __future__ import annotations

import pytest
import torch

from conftest import claim, tiny_config, wait_for_round
from diloco.wire.codec import Fp32Codec
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

pytestmark = pytest.mark.integration


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


def _correlated(shapes, shared: dict, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """An island's pseudo-gradient as honest ones are: a direction the islands share plus noise of its own."""
    own = _pg(shapes, seed)
    return {n: scale * (shared[n] + own[n]) for n in shapes}


def _flat(params: dict) -> torch.Tensor:
    return torch.cat([params[n].detach().reshape(-1).clone() for n in sorted(params)])


def test_a_push_against_the_others_is_dropped_and_the_parameters_move_with_the_majority(make_coordinator, channel_to):
    """Item 4: one island in three pushes -2.7x its honest update with an honest claim. Its norm is under the guard's
    factor (3), so clipping lets it through and the mean turns around; its direction is what gives it away."""
    cfg = tiny_config("rounds.rounds=4", "rounds.min_islands=3")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    a, b, attacker = (_join(stub, k) for k in "abc")
    shapes = coordinator.state.manifest.shapes
    for round_ in range(2):
        shared = _pg(shapes, 100 + round_)
        before = _flat(coordinator.state.params)
        _push(stub, coordinator, a, round_, _correlated(shapes, shared, 10 * round_ + 1))
        _push(stub, coordinator, b, round_, _correlated(shapes, shared, 10 * round_ + 2))
        _push(stub, coordinator, attacker, round_, _correlated(shapes, shared, 10 * round_ + 3, scale=-2.7))
        wait_for_round(coordinator, round_)
        summary = coordinator.state.summaries[-1]
        assert list(summary.islands) == sorted([a, b]) and not summary.clipped, summary
        moved = before - _flat(coordinator.state.params)  # the outer step goes down the mean pseudo-gradient
        assert float(torch.nn.functional.cosine_similarity(moved, _flat(shared), 0)) > 0.5


def test_honest_rounds_fold_the_same_bits_with_the_direction_check_on_and_off(make_coordinator, channel_to):
    """The check only ever drops: three honest islands (and independent noise, as other tests push) end on the same
    checksum with it on as with it off."""
    checksums = []
    for check in ("true", "false"):
        coordinator = make_coordinator(tiny_config("rounds.rounds=3", "rounds.min_islands=3", f"robust.direction_check={check}"))
        stub = channel_to(coordinator)
        islands = [_join(stub, k) for k in "abc"]
        shapes = coordinator.state.manifest.shapes
        for round_ in range(3):
            shared = _pg(shapes, 200 + round_)
            for k, island in enumerate(islands):
                pg = _correlated(shapes, shared, 10 * round_ + k) if round_ < 2 else _pg(shapes, 50 + k)
                _push(stub, coordinator, island, round_, pg)
            wait_for_round(coordinator, round_)
            assert len(coordinator.state.summaries[-1].islands) == 3
        checksums.append(coordinator.state.fragments[0].checksum)
    assert checksums[0] == checksums[1]


def test_a_lone_first_push_waits_for_a_second_island_and_is_judged_against_it(make_coordinator, channel_to):
    """Item 2: with the default min_islands (1) an attacker that joins first and pushes 1,000x its update alone in
    round 0 was folded whole (no reference yet). With the default robust.first_quorum (2) the run's first outer step
    waits for two contributions, and the second is the reference the first is clipped to."""
    coordinator = make_coordinator(tiny_config("rounds.rounds=3"))
    stub = channel_to(coordinator)
    attacker = _join(stub, "m")
    shapes = coordinator.state.manifest.shapes
    response = _push(stub, coordinator, attacker, 0, _pg(shapes, 1, scale=1.0))  # 1,000x the honest scale
    assert response.contribution_complete
    fragment = coordinator.state.fragments[0]
    with fragment.cond:
        assert fragment.close_reason() is None and fragment.round == 0  # would close now under min_islands=1 alone
    honest = _join(stub, "h")
    _push(stub, coordinator, honest, 0, _pg(shapes, 2))
    wait_for_round(coordinator, 0)
    summary = coordinator.state.summaries[-1]
    assert list(summary.clipped) == [attacker] and sorted(summary.islands) == sorted([attacker, honest])
    assert fragment.guard.quorum() == 1  # from here a lone push is judged against the run's history
