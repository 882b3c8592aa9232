"""Muon as the inner optimizer (diloco/models/muon.py): which parameters it takes, torch's arithmetic exactly,
state that round-trips, and a 1 x 2 FSDP group stepping exactly as one rank does (healing included).

The resume tests (tests/test_shard_checkpoint.py) run a Muon case too.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import pytest
import torch

from conftest import spawn_gloo_ranks, tiny_config
from diloco.data.sources import StepIndexedStream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.models.llama import Transformer
from diloco.models.muon import MuonAdamW, split_parameters

STEPS = 6


def _cfg(*extra: str):
    # d_ff 37: the MLP's matrices have an odd number of rows, so FSDP2 shards them unevenly.
    return tiny_config("model.n_layers=2", "model.d_ff=37", "inner.optimizer='muon'", "inner.muon_lr=0.02",
                       "inner.warmup_steps=2", "inner.lr=0.01", *extra)


def _model(cfg, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg.model)


def _train(model, optimizer, cfg, steps: range, total: int = STEPS) -> None:
    data = StepIndexedStream(cfg.data, 0, 0, 1)
    for step in steps:
        train_step(model, optimizer, data.batch_at(step, 4), inner_lr(step, total, cfg.inner), cfg.inner.grad_clip)


@pytest.mark.unit
@pytest.mark.parametrize("tied", [True, False])
def test_muon_takes_the_blocks_matrices_and_adamw_the_embedding_head_and_norms(tied):
    model = _model(_cfg(f"model.tie_embeddings={str(tied).lower()}"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in part] for part in split_parameters(model))
    assert muon and all(n.startswith("blocks.") and n.endswith("_proj.weight") for n in muon), muon
    assert decay == (["embed.weight"] if tied else ["embed.weight", "lm_head.weight"])
    assert all(model.get_parameter(n).dim() == 1 for n in no_decay) and "norm.weight" in no_decay
    optimizer = build_inner_optimizer(model, _cfg().inner)
    assert [len(g["params"]) for g in optimizer.param_groups] == [len(muon), len(decay), len(no_decay)]


@pytest.mark.unit
def test_one_rank_steps_are_torch_muon_and_adamw_side_by_side():
    """MuonAdamW under the inner schedule is exactly torch.optim.Muon at muon_lr's share of it plus AdamW."""
    cfg = _cfg()
    ours, theirs = _model(cfg), _model(cfg)
    mine = build_inner_optimizer(ours, cfg.inner)
    matrices, decay, no_decay = split_parameters(theirs)
    muon = torch.optim.Muon(matrices, lr=cfg.inner.muon_lr, weight_decay=cfg.inner.weight_decay, momentum=0.95,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=cfg.inner.lr, betas=tuple(cfg.inner.betas), foreach=True)
    data = StepIndexedStream(cfg.data, 0, 0, 1)
    for step in range(STEPS):
        lr = inner_lr(step, STEPS, cfg.inner)
        train_step(ours, mine, data.batch_at(step, 4), lr, cfg.inner.grad_clip)
        _, loss = theirs(*data.batch_at(step, 4))
        muon.zero_grad(), adamw.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), cfg.inner.grad_clip, foreach=True)
        for g in muon.param_groups:
            g["lr"] = lr * cfg.inner.muon_lr / cfg.inner.lr
        for g in adamw.param_groups:
            g["lr"] = lr
        muon.step(), adamw.step()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p, q), name
    assert _model(cfg).embed.weight.ne(ours.embed.weight).any(), "nothing trained"


@pytest.mark.unit
def test_state_dict_round_trip_goes_on_bit_identically():
    cfg = _cfg()
    straight = _model(cfg)
    optimizer = build_inner_optimizer(straight, cfg.inner)
    _train(straight, optimizer, cfg, range(3))
    resumed = copy.deepcopy(straight)
    fresh = build_inner_optimizer(resumed, cfg.inner)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert isinstance(fresh, MuonAdamW) and fresh.muon.state is fresh.state and fresh.adamw.param_groups[0] is fresh.param_groups[1]
    _train(straight, optimizer, cfg, range(3, STEPS))
    _train(resumed, fresh, cfg, range(3, STEPS))
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name


# --- a 1 x 2 FSDP group against one rank ------------------------------------------------------------


def _rank(rank: int, world_size: int, workdir: str) -> None:
    """One rank of the group: the same start and the same batch on both ranks, so the averaged gradient is one
    rank's; then a heal (the peer's state through optimizer_state_to_local / _from_local) and one more step."""
    from islands.fsdp import build_sharded_model, local_views, optimizer_state_from_local, optimizer_state_to_local, shard_range

    torch.set_num_threads(1)
    cfg = _cfg()
    start = dict(_model(cfg).named_parameters())

    def sharded():
        model = build_sharded_model(cfg.model, torch.device("cpu"), world_size)[0]
        with torch.no_grad():
            for name, p in model.named_parameters():
                r = shard_range(name, p)
                local_views(model)[name].copy_(start[name].reshape(-1)[r.offset : r.offset + r.numel])
        return model

    model = sharded()
    optimizer = build_inner_optimizer(model, cfg.inner)
    assert optimizer.muon.sharded  # the gathering step, not torch's own on DTensors
    _train(model, optimizer, cfg, range(STEPS), total=STEPS + 1)
    buffer = io.BytesIO()  # what torchft's HTTP transport carries: a pickled state dict of local tensors
    torch.save(optimizer_state_to_local(optimizer), buffer)
    healed = sharded()
    with torch.no_grad():
        for name, t in local_views(model).items():
            local_views(healed)[name].copy_(t)
    healed_optimizer = build_inner_optimizer(healed, cfg.inner)
    optimizer_state_from_local(healed_optimizer, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    _train(model, optimizer, cfg, range(STEPS, STEPS + 1), total=STEPS + 1)
    _train(healed, healed_optimizer, cfg, range(STEPS, STEPS + 1), total=STEPS + 1)
    views, healed_views = local_views(model), local_views(healed)
    ranges = {name: (r.offset, r.numel) for name, r in ((n, shard_range(n, p)) for n, p in model.named_parameters())}
    torch.save({"ranges": ranges, "model": {n: t.clone() for n, t in views.items()},
                "healed_equal": {n: torch.equal(t, healed_views[n]) for n, t in views.items()}},
               Path(workdir) / f"rank{rank}.pt")


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_sharded_group_steps_as_one_rank_and_a_healed_group_goes_on_exactly(tmp_path, monkeypatch):
    spawn_gloo_ranks(_rank, 2, tmp_path, monkeypatch)
    cfg = _cfg()
    single = _model(cfg)
    _train(single, build_inner_optimizer(single, cfg.inner), cfg, range(STEPS + 1), total=STEPS + 1)
    start = dict(_model(cfg).named_parameters())
    matrices = {id(p) for p in split_parameters(single)[0]}
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(got["healed_equal"].values()), got["healed_equal"]
        for name, p in single.named_parameters():
            offset, numel = got["ranges"][name]
            expected = p.detach().reshape(-1)[offset : offset + numel]
            # Elementwise kernels round a shard's elements as the whole tensor's (up to vector alignment).
            torch.testing.assert_close(got["model"][name], expected, rtol=0, atol=1e-6, msg=f"rank {rank}: {name}")
            if id(p) in matrices and numel:
                assert not torch.equal(expected, start[name].reshape(-1)[offset : offset + numel]), name


@pytest.mark.unit
def test_config_validates_muon_and_other_optimizers_hash_as_before():
    from diloco.config import ConfigError, config_from_dict, load_config

    plain = load_config(None)
    # In a config file (a --set of it without Muon is refused: test_config.py).
    assert config_from_dict({"inner": {"muon_lr": 0.5}}).digest() == plain.digest(), "Muon settings changed a non-Muon run's digest"
    muon = load_config(None, ["inner.optimizer='muon'"])
    assert muon.digest() != plain.digest() != load_config(None, ["inner.optimizer='muon'", "inner.muon_lr=0.5"]).digest()
    with pytest.raises(ConfigError, match="muon_adjust_lr"):
        load_config(None, ["inner.optimizer='muon'", "inner.muon_adjust_lr='moonlight'"])
