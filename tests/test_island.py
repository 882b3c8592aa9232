"""The island's inner loop: schedule across the run, decay on matrices only, state kept across rounds."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import one_island_config, tiny_config
from diloco.config import InnerConfig
from diloco.inner import build_inner_optimizer, inner_lr
from diloco.models.llama import Transformer
from diloco.params import checksum
from islands.client import CoordinatorClient
from islands.island import Island
from islands.world import IslandWorld


@pytest.mark.unit
def test_schedule_warms_up_then_decays_to_floor_across_the_run():
    cfg = InnerConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lrs = [inner_lr(s, 100, cfg) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == pytest.approx(0.1)
    # Indexed by the global inner step: round 3's first step is not a fresh warmup.
    assert 0.1 < inner_lr(3 * 20, 100, cfg) < 0.9


@pytest.mark.unit
def test_weight_decay_applies_to_matrices_only():
    model = Transformer(tiny_config().model)
    opt = build_inner_optimizer(model, InnerConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name


@pytest.mark.integration
def test_inner_optimizer_state_survives_rounds_and_island_adopts_global(make_coordinator):
    cfg = one_island_config("rounds.rounds=3", "inner.steps_per_round=4")
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    try:
        island = Island(cfg, world, client, client.join(cfg.digest()))
        result = island.run()
    finally:
        client.close()
        world.shutdown()
    assert result.rounds == 3 and result.checksum_matches
    steps = {int(s["step"]) for s in island.ctx.optimizer.state.values()}
    assert steps == {3 * 4}, "AdamW state was reset between rounds"
    assert checksum(dict(island.ctx.model.named_parameters())) == coordinator.state.checksum
    assert checksum(island.global_params) == coordinator.state.checksum
    assert all(torch.isfinite(t).all() for t in island.global_params.values())


@pytest.mark.integration
def test_compiled_island_trains_like_the_eager_one_and_keeps_the_exact_global_parameters(make_coordinator):
    """--compile: torch.compile in place; the manifest (parameter names) and the exchange are unchanged.

    Compiling takes tens of seconds on two busy cores and holds the GIL for long
    stretches: the island heartbeats as a real one does, and the lease is long
    enough that a starved heartbeat thread cannot cost it its membership.
    """
    results = {}
    for compiled in (False, True):
        cfg = one_island_config("rounds.rounds=2", "inner.steps_per_round=3", "rounds.lease_s=600", "rounds.deadline_s=600")
        coordinator = make_coordinator(cfg)
        world = IslandWorld.init("cpu")
        client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
        try:
            torch.manual_seed(0)
            island = Island(cfg, world, client, client.join(cfg.digest()), compile_model=compiled)
            client.start_heartbeat(lambda: island.island_id, cfg.rounds.heartbeat_s, lambda: island.round)
            result = island.run()
        finally:
            client.close()
            world.shutdown()
        assert result.rounds == 2 and result.checksum_matches
        assert (island.ctx.model._compiled_call_impl is not None) == compiled
        assert checksum(island.global_params) == coordinator.state.checksum
        results[compiled] = {n: t.clone() for n, t in coordinator.state.params.items()}
    # Same data, same start: compiled kernels may round differently, so close rather than equal.
    for name, eager in results[False].items():
        torch.testing.assert_close(results[True][name], eager, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.unit
def test_dropped_leases_restart_every_fragments_claim_and_a_stale_refusal_drops_nothing():
    """After the coordinator refuses our samples (NOT_LEASED), each fragment's next push names only the samples trained
    from then on and claims only their tokens; a refusal of samples named before that drop keeps the new leases."""
    from islands.state import IslandState

    s = IslandState("east", [0, 0], stop_round=10)
    s.add_lease([(100, 110)])
    for _ in range(4):  # 4 steps of 2 samples of 32 tokens, both fragments
        s.consume(2)
        s.tokens = [t + 64 for t in s.tokens]
    assert s.positions(s.data_marks[1], s.data_cursor) == [(100, 108)] and s.tokens == [256, 256]
    named_at = s.leases_forgotten  # an exchange of fragment 1 in flight names [100, 108)
    assert s.forget_leases(named_at)
    s.add_lease([(500, 510)])
    s.consume(2)
    s.tokens = [t + 64 for t in s.tokens]
    for f in (0, 1):  # the claim is what the push names
        assert s.positions(s.data_marks[f], s.data_cursor) == [(500, 502)] and s.tokens[f] == 2 * 32
    assert not s.forget_leases(named_at)  # fragment 1's old push refused too: the lease of [500, 510) stays
    assert s.pieces == [[500, 510]] and s.untrained() == [(502, 510)]


@pytest.mark.unit
def test_island_ranks_on_one_machines_cpu_share_its_cores_and_a_gone_rank_gives_its_share_back(tmp_path):
    from islands.cores import CoreShare

    before = torch.get_num_threads()
    first = CoreShare(tmp_path, cores=4)
    try:
        assert first.apply() == 4 == torch.get_num_threads()  # alone on the machine: every core
        second = CoreShare(tmp_path, cores=4)  # another island starts beside it
        assert second.apply() == 2 and first.apply() == 2
        third = CoreShare(tmp_path, cores=4)
        assert first.ranks() == 3 and first.apply() == 1  # 4 // 3
        third.close()
        os.close(second.fd)  # as a SIGKILL drops its lock, leaving its file behind
        second.fd = -1
        assert first.apply() == 4 and sorted(p.name for p in tmp_path.iterdir()) == [first.path.name]
    finally:
        first.close()
        torch.set_num_threads(before)
    assert not list(tmp_path.iterdir())
