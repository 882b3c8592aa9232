"""DiLoCo degenerates to plain SGD: M=1, H=1, inner SGD, outer SGD with lr 1 and momentum 0.

In exact arithmetic theta_global - (theta_global - theta_local) is theta_local.
In fp32 the subtraction that forms the pseudo-gradient rounds whenever theta_local
is not within a factor 2 of theta_global (params near zero), so no fp32 wire
format can return every element of theta_local bit for bit. The test therefore
pins the run bit for bit to plain SGD composed with exactly that one rounding,
and bounds how far that is from plain SGD itself.
"""

from __future__ import annotations

import pytest
import torch

from conftest import one_island_config
from diloco.data.sources import StepIndexedStream
from diloco.models.llama import Transformer
from islands.launch import run_island
from islands.state import ReplicaSpec
from islands.world import IslandWorld

pytestmark = pytest.mark.integration

LR = 0.05


def test_one_island_one_step_rounds_reproduce_plain_sgd(make_coordinator):
    rounds = 6
    cfg = one_island_config(
        "inner.optimizer='sgd'", "inner.schedule='constant'", f"inner.lr={LR}", "inner.grad_clip=0.0",
        "inner.steps_per_round=1", "outer.lr=1.0", "outer.momentum=0.0", f"rounds.rounds={rounds}",
        "data.shards=1",
    )
    coordinator = make_coordinator(cfg)
    world = IslandWorld.init("cpu")
    try:
        result = run_island(f"127.0.0.1:{coordinator.port}", cfg, world, ReplicaSpec())
    finally:
        world.shutdown()
    assert result.rounds == rounds and result.checksum_matches

    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    data = StepIndexedStream(cfg.data, cfg.seed, shard=0, num_shards=1)  # the batch of inner step s
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    exact, total = 0, 0
    for step in range(rounds):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(theta[n])
        sgd = torch.optim.SGD(model.parameters(), lr=LR)
        inputs, targets = data.batch_at(step, cfg.inner.batch_size)
        _, loss = model(inputs, targets)
        sgd.zero_grad()
        loss.backward()
        sgd.step()  # plain SGD: theta_sgd = theta - lr * g
        for n, p in model.named_parameters():
            theta_sgd = p.detach()
            pg = theta[n] - theta_sgd
            new = theta[n].clone().add_(pg, alpha=-1.0)  # the outer SGD step, lr 1
            # Off from plain SGD only by the rounding of pg: at most one ulp of pg.
            bound = pg.abs() * 2.0**-23
            assert bool(((new - theta_sgd).abs() <= bound).all()), n
            exact += int((new == theta_sgd).sum())
            total += new.numel()
            theta[n] = new

    for name, value in theta.items():
        assert torch.equal(coordinator.state.params[name], value), f"{name} differs from plain SGD + pg rounding"
    # Nearly every element is plain SGD's own value, bit for bit.
    assert exact / total > 0.97, f"only {exact}/{total} elements equal plain SGD"
