"""The island's side of the round (islands/round.py IslandRound), driven by a loop of the test's own.

No process, no network: the coordinator is an autospec'd CoordinatorClient (torchft's create_autospec style) whose
calls a small FakeCoordinator answers; time boxes run on tests/kit.py's fake Clock; the model is two parameters
trained by a hand-written loop that calls the round as any user's loop would (boundary, step_begins,
reduce_gradients, after_step after optimizer.step()).
"""

from __future__ import annotations

from unittest.mock import call, create_autospec

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from conftest import tiny_config
from diloco.fragments import Fragment, FragmentLayout
from diloco.streaming import EagerState
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.codec import get_codec
from diloco.wire.messages import Manifest
from diloco.wire.refusal import Reason
from islands.client import CoordinatorClient
from islands.context import FragmentShard, IslandContext
from islands.evidence import Faults
from islands.fsdp import ShardLayout, local_views
from islands.outcome import Next
from islands.replicas import ReplicaGroups, Replicas
from islands.round import Blocking, Eager, IslandRound, Overlapped, Wire, exchange_mode
from islands.state import IslandState, ReplicaSpec
from islands.world import IslandWorld
from kit import Clock

pytestmark = pytest.mark.unit

NAMES = ("blocks.0.w", "blocks.1.w")
SHAPES = {"blocks.0.w": (3,), "blocks.1.w": (2, 2)}
TOKENS = 128  # one inner step's tokens


class Toy(nn.Module):
    """Two parameters, one per fragment when there are two; the loss pulls them toward 0."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Module() for _ in NAMES)
        for block, name in zip(self.blocks, NAMES):
            block.w = nn.Parameter(torch.zeros(SHAPES[name]))

    def loss(self) -> torch.Tensor:
        return sum((p * p).sum() for p in self.parameters())


class Refusal(grpc.RpcError):
    """What the client raises for a typed refusal."""

    def __init__(self, reason: int):
        self.refusal = pb.Refusal(reason=reason)

    def details(self) -> str:
        return Reason.Name(self.refusal.reason)


def _fp32(chunk) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(bytes(chunk.payload), dtype=np.float32).copy())


class FakeCoordinator:
    """Answers an autospec'd CoordinatorClient: theta_global per fragment round, an outer step of theta - 0.5 * pg."""

    def __init__(self, layout: FragmentLayout, total_rounds: int):
        self.layout, self.total = layout, total_rounds
        self.theta = {n: torch.full(SHAPES[n], 1.0 + i) for i, n in enumerate(NAMES)}
        self.rounds = [0] * len(layout)
        self.pushes: list[tuple[pb.PushHeader, dict[str, torch.Tensor]]] = []
        self.refuse: list[int] = []  # reasons to refuse the next pushes with
        self.client = create_autospec(CoordinatorClient, instance=True)
        self.client.codecs = {}
        self.client.fetch.side_effect = self.fetch
        self.client.push.side_effect = self.push
        self.client.pull.side_effect = self.pull
        self.client.leave.return_value = pb.LeaveResponse(checksum_matches=True, checksum="ok")

    def header(self, f: int) -> pb.ResultHeader:
        return pb.ResultHeader(round=self.rounds[f], checksum=f"f{f}r{self.rounds[f]}", run_finished=min(self.rounds) >= self.total,
                               tokens=2 * TOKENS)

    def fetch(self, island_id, targets, manifest, ranges=None, fragment=None):
        for n, t in targets.items():
            t.copy_(self.theta[n].view_as(t))
        if fragment is not None or len(self.rounds) == 1:
            return self.header(fragment or 0)
        h = self.header(0)
        h.fragments.extend(pb.FragmentState(index=f, round=r, checksum=self.header(f).checksum) for f, r in enumerate(self.rounds))
        return h

    def push(self, header, chunks):
        if self.refuse:
            raise Refusal(self.refuse.pop(0))
        pg: dict[str, torch.Tensor] = {}
        for chunk in chunks.iter_from(0):
            pg[chunk.name] = torch.cat([pg.get(chunk.name, torch.zeros(0)), _fp32(chunk)])
        self.pushes.append((header, pg))
        f = header.fragment
        for n, g in pg.items():
            self.theta[n] -= 0.5 * g.view(SHAPES[n])
        self.rounds[f] += 1
        return pb.PushResponse(accepted=True)

    def pull(self, island_id, round_, targets, manifest, held, timeout_s, ranges=None, fragment=0, mean=None):
        assert self.rounds[fragment] == round_ + 1, "pulled before the round closed"
        for n, t in targets.items():
            t.copy_(self.theta[n].view_as(t))
        return self.header(fragment)


def layout_of(p: int, h: int) -> FragmentLayout:
    if p == 1:
        return FragmentLayout((Fragment(0, NAMES, 0),), h)
    return FragmentLayout(tuple(Fragment(f, (NAMES[f],), f * h // p) for f in range(p)), h)


def island_round(cfg, *, clock=None, groups: int = 1, ft=None, faults: Faults | None = None) -> tuple[IslandRound, FakeCoordinator]:
    """The round over a Toy model's parts, as the island builds them for a one-rank island (no process group)."""
    p, h = cfg.streaming.fragments, cfg.inner.steps_per_round
    layout, total = layout_of(p, h), cfg.rounds.rounds
    coordinator = FakeCoordinator(layout, total)
    world = IslandWorld(0, 1, torch.device("cpu"))
    model = Toy()
    manifest = Manifest({n: SHAPES[n] for n in NAMES})
    params = FragmentShard(-1, manifest, ShardLayout.of(model).ranges, True, local_views(model),
                           {n: torch.zeros(SHAPES[n]) for n in NAMES})
    ctx = IslandContext(
        cfg, ReplicaSpec(groups=groups), world, coordinator.client, IslandState("island-1", [0] * p, total), layout, total,
        model, torch.optim.SGD(model.parameters(), lr=0.1), params, [params.part(f.index, f.names) for f in layout],
        ReplicaGroups(world, groups, ft), eager=[EagerState(cfg.outer) for _ in range(p)] if cfg.streaming.eager else None,
        faults=faults or Faults(),
    )
    wire = Wire(coordinator.client, get_codec("fp32"), 4096, None, 30.0, lambda: ctx.state.island_id,
                down=get_codec("fp32"))
    return IslandRound(ctx, wire, clock=clock or Clock()), coordinator


def train(rounds: IslandRound, steps: int | None = None, clock: Clock | None = None, step_s: float = 0.0) -> list[int]:
    """A user's loop: the round called around each optimizer step. Returns the steps at which a boundary was used."""
    ctx, used = rounds.ctx, []
    while not rounds.done() and (steps is None or ctx.state.step < steps):
        if rounds.boundary():
            used.append(ctx.state.step)
            continue
        rounds.step_begins()
        ctx.optimizer.zero_grad()
        loss = ctx.model.loss()
        loss.backward()
        value = rounds.reduce_gradients(ctx.model, loss.item())
        if value is None:
            continue
        ctx.optimizer.step()
        if clock is not None:
            clock.now += step_s
        rounds.after_step(value, TOKENS)
    return used


def test_a_blocking_round_pushes_theta_global_minus_local_and_adopts_the_result_at_the_sync_step():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=3", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    ctx = rounds.ctx
    assert isinstance(rounds.mode, Blocking) and not isinstance(rounds.mode, Overlapped)
    rounds.start()
    assert [torch.equal(ctx.params.local[n], coordinator.theta[n].view(-1)) for n in NAMES] == [True, True]
    before = {n: ctx.params.local[n].clone() for n in NAMES}

    assert train(rounds, steps=2) == []  # two inner steps; the sync is at the next boundary
    trained = {n: ctx.params.local[n].clone() for n in NAMES}
    losses = [sum((before[n] * 0.8 ** k).square().sum().item() for n in NAMES) for k in range(2)]
    assert rounds.boundary()  # the sync step: push, pull and landing in one
    header, pg = coordinator.pushes[0]
    assert (header.round, header.inner_steps, header.tokens, header.first_step) == (0, 2, 2 * TOKENS, 0)
    assert header.train_loss == pytest.approx(sum(losses) / 2)
    for n in NAMES:
        torch.testing.assert_close(pg[n], before[n] - trained[n])  # theta_global - theta_local
        assert torch.equal(ctx.params.local[n], coordinator.theta[n].view(-1))  # alpha 0: the result adopted as is
    assert ctx.state.rounds == [1] and ctx.state.checksums == ["f0r1"] and ctx.state.last_sync == [2]
    assert [e["round"] for e in ctx.exchanges] == [0] and ctx.state.rounds_done == 1
    assert rounds.losses == [pytest.approx(sum(losses) / 2)]

    assert train(rounds) == [4, 6] and rounds.done()
    assert [h.round for h, _ in coordinator.pushes] == [0, 1, 2]
    assert rounds.finish() is True and rounds.final_checksum == "ok"
    leave = coordinator.client.leave.call_args
    assert leave.args[:3] == ("island-1", "", 3) and leave.kwargs["fragment_checksums"] == ["f0r3"]
    assert leave.args[3]["inner_steps"] == 6


def test_an_overlapped_exchange_lands_tau_steps_later_into_a_staging_copy_and_the_last_round_blocks():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "streaming.tau=1", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    ctx = rounds.ctx
    assert type(rounds.mode) is Overlapped
    rounds.start()
    train(rounds, steps=2)
    held = {n: t.clone() for n, t in ctx.params.global_.items()}
    assert not rounds.boundary()  # round 0's exchange begins; the step trains on
    ex = rounds.inflight[0]
    assert (ex.pushed_step, ex.due, ex.background) == (2, 3, True)
    ex.thread.join()  # its pull is in; theta_global is untouched until the landing
    assert all(torch.equal(ctx.params.global_[n], held[n]) for n in NAMES)
    assert rounds.lr_step() == 2
    train(rounds, steps=3)
    assert rounds.boundary() and not rounds.inflight and ctx.state.rounds == [1]  # landed at step 3
    assert all(torch.equal(ctx.params.global_[n], coordinator.theta[n]) for n in NAMES)
    assert ctx.state.last_sync == [2]  # the next round counts from its sync, not its landing
    train(rounds, steps=4)
    assert rounds.boundary()  # the run's last round: blocking, landed at its sync
    assert ctx.exchanges[-1]["due"] == ctx.exchanges[-1]["pushed_step"] == 4 and rounds.done()


def test_the_exchange_seam_is_chosen_once_from_the_config():
    blocking, overlapped, eager = (tiny_config("model.n_layers=2", *o) for o in (
        [], ["streaming.tau=1"], ["streaming.tau=1", "streaming.eager=true", "streaming.fragments=2"]))
    assert type(exchange_mode(blocking, None, None, None)) is Blocking
    assert type(exchange_mode(overlapped, None, None, None)) is Overlapped
    assert type(exchange_mode(eager, None, [], None)) is Eager
    rounds, _ = island_round(eager)
    assert type(rounds.mode) is Eager and rounds.mode.eager is rounds.ctx.eager


def test_fragments_sync_on_the_fixed_schedule_and_land_in_index_order():
    cfg = tiny_config("model.n_layers=2", "inner.steps_per_round=4", "rounds.rounds=2", "streaming.fragments=2",
                      "streaming.tau=1", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    rounds.start()
    train(rounds)
    # Fragment 1 (offset H/2) syncs at step 2, fragment 0 at step 4; the last round of both at 8, in index order.
    assert [(h.fragment, h.round, h.inner_steps) for h, _ in coordinator.pushes] == [(1, 0, 2), (0, 0, 4), (0, 1, 4), (1, 1, 6)]
    assert [(e["fragment"], e["pushed_step"], e["due"]) for e in rounds.ctx.exchanges] == [(1, 2, 3), (0, 4, 5), (0, 8, 8), (1, 8, 8)]
    assert rounds.ctx.state.rounds == [2, 2] and rounds.finish() is True


def test_a_time_boxed_round_ends_when_the_fake_clock_says_and_does_not_count_time_blocked_on_a_result():
    cfg = tiny_config("inner.steps_per_round=4", "inner.max_steps=8", "rounds.rounds=2", "rounds.mode='time'",
                      "rounds.round_s=1.0", "wire.codec='fp32'")
    clock = Clock()
    rounds, coordinator = island_round(cfg, clock=clock)
    rounds.start()
    train(rounds, steps=3, clock=clock, step_s=0.3)
    assert not rounds.round_over(0)  # 0.9 s
    rounds.ctx.timing["wait_s"] += 5.0  # blocked meanwhile: not the round's time
    clock.now += 5.0
    assert not rounds.round_over(0)
    train(rounds, steps=4, clock=clock, step_s=0.3)
    assert rounds.round_over(0) and rounds.boundary()  # 1.2 s of its own
    header, _ = coordinator.pushes[0]
    assert (header.inner_steps, header.first_step) == (4, 0)
    assert rounds.lr_step() == 4  # round 1's first step on the lr schedule: round * H


def test_a_refused_push_resyncs_the_fragment_from_the_coordinator():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=3", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    ctx = rounds.ctx
    rounds.start()
    train(rounds, steps=2)
    coordinator.refuse = [Reason.ROUND_CLOSED]
    coordinator.rounds = [2]  # the run went on without us
    coordinator.theta = {n: t + 3.0 for n, t in coordinator.theta.items()}
    assert rounds.boundary()
    assert ctx.state.resyncs == 1 and ctx.state.rounds == [2] and ctx.state.checksums == ["f0r2"]
    assert all(torch.equal(ctx.params.local[n], coordinator.theta[n].view(-1)) for n in NAMES)
    assert ctx.state.step == 4 and ctx.state.last_sync == [4]  # moved to round 2's start (align_step)
    assert not coordinator.client.pull.called


def test_a_push_refused_as_not_finite_resets_training_through_the_context():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    rounds.start()
    train(rounds, steps=2)
    old = rounds.ctx.optimizer
    coordinator.refuse = [Reason.NOT_FINITE]
    assert rounds.boundary() and rounds.ctx.optimizer is not old and rounds.ctx.state.resyncs == 1


def test_the_quorum_leader_takes_over_a_push_nobody_reported_and_the_landing_is_agreed_again():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    ft = create_autospec(Replicas, instance=True)
    ft.commit.return_value = True
    ft.participating_rank.return_value = 1  # at the sync another group leads: this one encodes only
    rounds, coordinator = island_round(cfg, groups=2, ft=ft)
    ft.allreduce_.side_effect = lambda t, op=None: None  # every other group reports NOBODY too
    rounds.start()
    rounds.ctx.state.step = 2  # trained (the gradients' agreement is another test's)
    rounds.begin(0)
    assert not coordinator.pushes and rounds.inflight[0].status is Next.NOBODY
    ft.participating_rank.return_value = 0  # the pushing group died: this one leads the quorum now
    assert rounds.land(0) is False and rounds.takeovers == 1 and len(coordinator.pushes) == 1
    assert rounds.land(0) is True and rounds.ctx.state.rounds == [1]  # agreed DELIVERED at the next step


def test_a_landing_that_does_not_commit_is_redone_at_the_next_step():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    ft = create_autospec(Replicas, instance=True)
    ft.participating_rank.return_value = 0
    ft.commit.side_effect = [False, True]
    rounds, coordinator = island_round(cfg, groups=2, ft=ft)
    rounds.start()
    rounds.ctx.state.step = 2
    rounds.begin(0)
    assert rounds.land(0) is False and 0 in rounds.inflight
    assert rounds.land(0) is True and not rounds.inflight and coordinator.client.pull.call_count == 1


def test_groups_in_different_rounds_do_not_commit_the_step_and_resync():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    ft = create_autospec(Replicas, instance=True)
    ft.commit.return_value = False

    def another_round(flat, op=None):  # the other group's rounds tag differs
        flat[-2] += 1.0

    ft.allreduce_.side_effect = another_round
    rounds, coordinator = island_round(cfg, groups=2, ft=ft)
    rounds.start()
    model = rounds.ctx.model
    model.loss().backward()
    assert rounds.reduce_gradients(model, 1.0) is None
    ft.report_error.assert_called_once()
    assert rounds.ctx.state.resyncs == 1 and coordinator.client.fetch.call_count == 2


def test_one_group_keeps_its_own_gradients_and_loss():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    rounds, _ = island_round(cfg)
    model = rounds.ctx.model
    model.loss().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert rounds.reduce_gradients(model, 1.5) == 1.5
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_fault_points_are_the_injected_object_and_read_no_environment(monkeypatch):
    monkeypatch.setenv("DILOCO_FAULT", "die-before-push:round=0")  # read by nobody here: the round has its own
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "wire.codec='fp32'")
    faults = create_autospec(Faults, instance=True)
    faults.due.return_value = None
    rounds, _ = island_round(cfg, faults=faults)
    rounds.start()
    train(rounds, steps=2)
    assert rounds.boundary()
    assert faults.hit.call_args_list == [call("die-before-push", 0), call("hold-before-push", 0), call("die-before-land", 0, 0)]
    faults.due.assert_called_once_with("perturb-before-pull", 0)


def test_faults_name_a_point_for_one_rank_and_round_in_the_first_attempt_only():
    spec = "die-before-push:group=0,rank=1,round=3;perturb-before-pull:round=2,delay=0.5"
    mine = Faults(0, 1, spec)
    assert mine.due("die-before-push", 3) == {"group": "0", "rank": "1", "round": "3"}
    assert mine.due("die-before-push", 2) is None and Faults(0, 0, spec).due("die-before-push", 3) is None
    assert Faults(1, 5, spec).due("perturb-before-pull", 2) == {"round": "2", "delay": "0.5"}
    assert Faults(0, 1, spec, attempt_=1).due("die-before-push", 3) is None
    assert Faults().due("die-before-push", 0) is None


def test_a_healing_group_receives_the_exchanges_in_flight_and_the_round_clock():
    cfg = tiny_config("inner.steps_per_round=2", "rounds.rounds=2", "streaming.tau=1", "wire.codec='fp32'")
    rounds, coordinator = island_round(cfg)
    rounds.start()
    train(rounds, steps=2)
    assert not rounds.boundary()
    rounds.inflight[0].thread.join()
    saved = rounds.heal_state_dict()
    ft = create_autospec(Replicas, instance=True)
    ft.commit.return_value, ft.participating_rank.return_value = True, 1
    ft.allreduce_.side_effect = lambda t, op=None: t.add_(Next.DELIVERED)  # the pushing group reports its push
    healed, _ = island_round(cfg, groups=2, ft=ft)
    healed.ctx.client = coordinator.client  # the same coordinator
    healed.wire.client = coordinator.client
    healed.ctx.state.load_state_dict(rounds.ctx.state.state_dict())
    inflight = healed.inflight
    healed.load_heal_state_dict(saved)
    assert healed.inflight is inflight and healed.schedule.inflight is inflight  # one dict, read by the schedule too
    ex = healed.inflight[0]
    assert (ex.round, ex.due, ex.pusher, ex.status) == (0, 3, False, Next.NOBODY) and ex.pushed.is_set()
    assert torch.equal(ex.pg["blocks.0.w"], rounds.inflight[0].pg["blocks.0.w"])
    healed.ctx.state.step = 3
    assert healed.boundary() and healed.ctx.state.rounds == [1] and healed.takeovers == 0  # it pulls at the landing
    assert all(torch.equal(healed.ctx.params.global_[n], coordinator.theta[n]) for n in NAMES)
