"""One algorithm, called by everyone: the convergence benchmark's round is the coordinator's, bit for bit.

The same pushes (the same encoded chunks) go to a coordinator's round machine (CoordinatorState.receive and
FragmentRounds.step, no gRPC) and through the benchmark's Wire (benchmarks/convergence_wire.py); both judge, fold and step
with diloco/aggregate.py, so after every round the global parameters, the outer momentum and what islands hold
must be equal to the bit. The rounds go through what the guard does: an honest round, one contribution clipped
(or dropped by its norm), one dropped for its direction, and every contribution far off at once (all clipped, or
all dropped: no outer step).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.convergence_wire import Wire
from conftest import claim, random_like, trained_from
from coordinator.rounds import lr_sum
from diloco.v1 import diloco_pb2 as pb
from kit import make_state

pytestmark = pytest.mark.unit

RANKS = (1, 2, 3, 1)  # island-N joins declaring RANKS[N]: 128, 256, 384 and 128 tokens a round, unequal weights
# Each round's scale of each island's honest pseudo-gradient: -2 points against the others (the direction check
# drops it), 20 and 100 are norm outliers (clipped, or dropped with robust.action 'drop'). The last round is judged
# against the four before it (the guard's history): all four far off at once.
SCALES = ((1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 20), (1, 1, -2, 1), (100, 100, 100, 100))


def pseudo_gradients(shapes, round_: int) -> list[dict[str, torch.Tensor]]:
    """Four islands' pseudo-gradients for a round: a shared direction plus each island's own noise, so honest ones
    agree (cosines well above the guard's -0.1) and a negated one stands against the majority."""
    shared = random_like(shapes, 1000 + round_)
    return [{n: scale * (shared[n] + 0.5 * own[n]) for n in shapes}
            for scale, own in zip(SCALES[round_], (random_like(shapes, 10 * round_ + i) for i in range(4)))]


def momentum(outer) -> dict[str, torch.Tensor]:
    return {n: outer.optimizer.state[p]["momentum_buffer"] for n, p in outer.params.items()}


def run_both(tmp_path, overrides: tuple[str, ...], tokens_off: dict[int, int] | None = None) -> list[dict]:
    """Every round of SCALES through a coordinator and through the benchmark's Wire; tokens_off: tokens the benchmark
    is told an island trained on beyond what the coordinator is (a changed weight). Returns each round's results."""
    state = make_state(tmp_path, "rounds.rounds=8", *overrides)
    for ranks in RANKS:
        state.join("test", ranks=ranks)
    fragment = state.fragments[0]
    wire = Wire(state.cfg, {n: t.clone() for n, t in fragment.outer.params.items()}, len(RANKS))
    results = []
    for round_ in range(len(SCALES)):
        started_from, pushes = fragment.checksum, []
        for i, pg in enumerate(pseudo_gradients(state.manifest.shapes, round_)):
            header = pb.PushHeader(island_id=f"island-{i}", round=round_, train_loss=2.0, codec=wire.codec.name,
                                   global_checksum=trained_from(state, round_), **claim(state.cfg, 1, RANKS[i]))
            # The island's chunks, encoded once (with its error feedback, when on), go to both.
            pushes.append(wire.push(i, pg, header.tokens + (tokens_off or {}).get(i, 0), lr_sum(header, state.cfg)))
            assert state.receive(header, iter(pushes[-1].chunks_sent)).contribution_complete
        judged = wire.round(pushes, len(RANKS))
        closed = state.fragments[0].step(poll_s=0)
        assert closed is not None and state.round == round_ + 1
        summary = closed.summary
        assert judged == len(summary.clipped) + len(summary.dropped)
        results.append({
            "clipped": list(summary.clipped), "dropped": list(summary.dropped), "stepped": fragment.checksum != started_from,
            "same": {
                "theta": _equal(fragment.outer.params, wire.outer.params),
                "momentum": _equal(momentum(fragment.outer), momentum(wire.outer)),
                "held by islands": _equal(fragment.publication.params, wire.publication.params),
                "checksum": fragment.checksum == wire.publication.checksum,
            },
        })
    return results


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("codec,action", [("fp32", "clip"), ("e3m0", "clip"), ("e3m0", "drop")])
def test_the_benchmarks_round_is_the_coordinators_bit_for_bit(tmp_path, codec, action):
    """fp32 and 4-bit (e3m0) both ways: the lossy downlink takes the coordinator's streamed step and publication
    (publish.step_and_publish), the benchmark the plain step and publish; both the same bits."""
    overrides = (f"wire.codec='{codec}'", f"wire.downlink_codec='{codec}'", f"robust.action='{action}'")
    results = run_both(tmp_path, overrides)
    for round_, r in enumerate(results):
        assert all(r["same"].values()), (round_, r)
    # The rounds did what they are there for: the guard clipped or dropped the outlier, the direction check the
    # negated one, and the far-off round had every contribution clipped, or dropped (then no step: nothing moved).
    outlier = "dropped" if action == "drop" else "clipped"
    assert all(r["clipped"] == r["dropped"] == [] for r in results[:2])
    assert results[2][outlier] == ["island-3"]
    assert results[3]["dropped"] == ["island-2"] and results[3]["clipped"] == []
    assert sorted(results[4][outlier]) == [f"island-{i}" for i in range(4)]
    assert [r["stepped"] for r in results] == [True, True, True, True, action == "clip"]


def test_a_changed_weight_is_caught(tmp_path):
    """The comparison can fail: the benchmark told island-1 trained 128 more tokens than it claimed to the coordinator
    folds another mean, and the test above would see it in the parameters, the momentum and the checksum."""
    results = run_both(tmp_path, ("wire.codec='fp32'",), tokens_off={1: 128})
    assert not any(results[0]["same"].values()), results[0]
