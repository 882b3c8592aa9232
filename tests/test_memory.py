"""The coordinator's memory by component (coordinator/memory.py), counted from the live objects of a tiny run.

The state machine is driven by hand (tests/kit.py): pushes go straight into CoordinatorState.receive and the round
is closed with FragmentRounds.step, so every figure is known exactly: a tensor's bytes are 4 x its elements.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_like
from kit import make_state, push
from coordinator.memory import COMPONENTS, StorageCounter, held_tensors
from coordinator.metrics import coordinator_metrics
from diloco.wire.frames import serialized_values
from coordinator.state import CoordinatorState
from diloco.robust import SKETCH_DIM

pytestmark = pytest.mark.unit


def one_round(state: CoordinatorState) -> None:
    """Two islands push round 0 and it closes (the first outer step waits for two: robust.first_quorum)."""
    islands = [state.join(h).island_id for h in "ab"]
    for k, island in enumerate(islands):
        assert push(state, island, random_like(state.manifest.shapes, k)).contribution_complete
    assert state.fragments[0].step(poll_s=0) is not None and state.round == 1


def test_a_closed_round_is_accounted_by_component_exactly(tmp_path):
    state = make_state(tmp_path)
    model = 4 * state.manifest.total_numel()
    before = state.memory()
    assert list(before) == list(COMPONENTS)
    assert before["outer_params"] == model and before["accumulator"] == model
    assert before["momentum"] == 0, "torch allocates the momentum at the first outer step"
    assert before["spool_pool"] == 0, "the pool allocates its blocks as pushes arrive"
    one_round(state)
    now = state.memory()
    assert list(now) == list(COMPONENTS)
    assert now["outer_params"] == model
    assert now["momentum"] == model
    assert now["accumulator"] == model
    # A lossless downlink publishes the outer optimizer's own tensors: nothing more to hold.
    assert state.publication.lossless and state.publication.file is None
    assert all(state.publication.params[n] is t for n, t in state.outer_params.items())
    assert now["delta_chunks"] == now["accumulator_late"] == now["eager_mean"] == now["evaluator"] == 0
    # Two fp32 pushes fit in one model's pool: its blocks are allocated and kept once the round released them.
    pool = state.memory_pool()
    assert now["spool_pool"] == pool["allocated"] == state.spools.pool.allocated * state.spools.pool.block_bytes > 0
    assert pool["in_use"] == 0 and pool["allocated"] <= pool["capacity"]
    assert now["published_values"] == 0, "nobody pulled the values yet"
    # The round driver sampled before the fold and after the publication.
    report = state.memory_report()
    assert report["samples"] == 2 and report["model_fp32_bytes"] == model
    assert report["peak"]["momentum"] == model and report["peak"]["accumulator"] == model
    assert report["peak"]["spool_pool"] == pool["allocated"]
    assert report["peak_sum"] >= sum(report["at_peak_total"].values()) >= sum(before.values())


def test_a_pull_holds_no_copy_of_the_values(tmp_path):
    """A pull frames the values from the parameters: the version holds the chunks' digests, not the model."""
    state = make_state(tmp_path)
    one_round(state)
    serialized = sum(len(data) for data in serialized_values(state.params, state.cfg.wire.chunk_bytes))
    with state.fragments[0].reading() as reading:
        sent = sum(len(data) for data in reading.value_messages(None))
        assert sent == serialized > 4 * state.manifest.total_numel()
        held = state.memory()["published_values"]
        assert 0 < held == 8 * len(reading.values[0].spans) < serialized / 100
    # The next round's step supersedes them; nobody reads them any more, so they are dropped.
    islands = list(state.islands)
    for k, island in enumerate(islands):
        push(state, island, random_like(state.manifest.shapes, 10 + k), round_=1)
    assert state.fragments[0].step(poll_s=0) is not None
    assert state.memory()["published_values"] == 0
    assert state.memory_report()["values_on_disk"] == 0, "nobody was reading across the step"

def test_a_lossy_downlink_keeps_its_published_copy_in_a_file_and_holds_the_update(tmp_path):
    state = make_state(tmp_path, "wire.codec='int8'")
    model = 4 * state.manifest.total_numel()
    assert not state.publication.lossless
    one_round(state)
    now = state.memory()
    assert now["outer_params"] == now["momentum"] == now["accumulator"] == model
    # The copy every island holds is a file beside the spool (coordinator/filebacked.py), not a fourth model.
    assert "published_params" not in now and model <= state.memory_report()["published_on_disk"] < 2 * model
    assert state.publication.file is not None
    published = {n: t.clone() for n, t in state.params.items()}
    assert not all(torch.equal(published[n], t) for n, t in state.outer_params.items()), "int8 down: theta differs"
    delta = state.publication.delta_chunks
    assert delta and now["delta_chunks"] == sum(c.ByteSize() for c in delta) < model / 3


def test_delayed_nesterovs_carry_is_the_momentum(tmp_path):
    state = make_state(tmp_path, "rounds.late_rounds=1", "rounds.late_mode='delayed_nesterov'")
    one_round(state)
    outer = state.fragments[0].outer
    assert outer.carry and not any("momentum_buffer" in s for s in outer.optimizer.state.values())
    assert state.memory()["momentum"] == 4 * state.manifest.total_numel()


def test_the_late_part_and_an_evaluator_are_counted(tmp_path):
    held = torch.zeros(1000)
    view = held[10:20]

    def evaluate(params):  # a closure over a tensor and a view of it, as make_evaluator closes over its model
        return float(held.sum() + view.sum())

    cfg = make_state(tmp_path).cfg
    spool = tmp_path / "spool-own"
    spool.mkdir()
    state = CoordinatorState(cfg, {n: t.clone() for n, t in make_state(tmp_path).params.items()}, spool, evaluate=evaluate)
    assert state.memory()["evaluator"] == 4000, "a view is counted once, with its storage"
    state.fragments[0].accumulator.part(late=True)  # delayed Nesterov's late sums, allocated at the first late one
    assert state.memory()["accumulator_late"] == 4 * state.manifest.total_numel()


def test_the_closing_rounds_sketches_are_counted(tmp_path):
    """The direction check sketches each contribution as it arrives (three members or more); the close's first sample
    counts the sketches of the round it closes."""
    state = make_state(tmp_path)
    islands = [state.join(h).island_id for h in "abc"]
    for k, island in enumerate(islands):
        push(state, island, random_like(state.manifest.shapes, k))
    assert state.memory()["sketches"] == 3 * SKETCH_DIM * 8
    assert state.fragments[0].step(poll_s=0) is not None
    assert state.memory()["sketches"] == 0
    assert state.memory_report()["peak"]["sketches"] == 3 * SKETCH_DIM * 8


def test_storage_is_counted_once_whoever_holds_it():
    t = torch.zeros(64, 16)
    counter = StorageCounter()
    assert counter.count([t, t[3], t.view(-1)[5:9], t.T]) == 64 * 16 * 4
    assert counter.count([t]) == 0
    module = torch.nn.Linear(8, 4)
    assert StorageCounter().count(held_tensors([module, {"x": (t,)}])) == (8 * 4 + 4 + 64 * 16) * 4


def test_metrics_show_each_component(tmp_path):
    state = make_state(tmp_path)
    one_round(state)
    body, _ = coordinator_metrics(state)()
    text = body.decode()
    model = 4 * state.manifest.total_numel()
    for name in COMPONENTS:
        assert f'diloco_coordinator_memory_bytes{{component="{name}"}}' in text, name
    assert f'diloco_coordinator_memory_bytes{{component="momentum"}} {float(model)}' in text
    assert f'diloco_coordinator_memory_peak_bytes{{component="accumulator"}} {float(model)}' in text
    assert 'diloco_coordinator_spool_pool_bytes{kind="capacity"}' in text
