"""Checkpoints and restarts: exact resume, torn checkpoints, and a chaos run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from conftest import claim, ended, one_island_config, random_like, straight_and_resumed, tiny_config, trained_from, wait_for_round
from islands.sim.chaos import ChaosPlan, parse_chaos, run_chaos
from diloco.wire.codec import Fp32Codec
from islands.sim.simulation import run_sim
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import PROTOCOL_VERSION, tensor_chunks


def _sim_config(rounds: int, islands: int, *extra: str):
    return tiny_config(
        f"rounds.rounds={rounds}", f"rounds.min_islands={islands}", f"data.shards={islands}",
        "inner.steps_per_round=4", "inner.lr=1e-2", "inner.warmup_steps=2", "eval.batches=4",
        "checkpoint.every_rounds=1", "rounds.heartbeat_s=0.5", "rounds.lease_s=8", *extra,
    )


@pytest.mark.integration
def test_coordinator_resume_restores_parameters_momentum_round_and_members(make_coordinator, channel_to, tmp_path):
    cfg = one_island_config("rounds.rounds=5", f"checkpoint.url='{tmp_path / 'ckpt'}'", "checkpoint.every_rounds=1")
    first = make_coordinator(cfg)
    stub = channel_to(first)
    island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5).island_id
    for round_ in range(2):
        pg = random_like(first.state.manifest.shapes, seed=round_)
        messages = [pb.PushMessage(header=pb.PushHeader(island_id=island, round=round_, codec="fp32", **claim(cfg),
                                                         global_checksum=trained_from(first)))]
        messages += [pb.PushMessage(chunk=c) for c in tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)]
        stub.PushPseudoGradient(ended(messages), timeout=10)
        wait_for_round(first, round_)
    deadline = time.monotonic() + 10
    while first.state.summaries[-1].round < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the checkpoint is written right after the round closes
    params = {n: t.clone() for n, t in first.state.fragments[0].outer.params.items()}
    momentum = [s["momentum_buffer"].clone() for s in first.state.fragments[0].outer.optimizer.state.values()]
    first.stop(0.5)

    from coordinator.server import start_coordinator

    second = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / "spool2"), resume=True)
    try:
        s = second.state
        assert s.round == 2 and list(s.islands) == [island] and s.events.restarts == 1
        for name, t in params.items():
            assert torch.equal(s.fragments[0].outer.params[name], t)
        assert all(torch.equal(a["momentum_buffer"], b) for a, b in zip(s.fragments[0].outer.optimizer.state.values(), momentum))
        assert [r.round for r in s.summaries] == [0, 1]
    finally:
        second.stop(0.5)


@pytest.mark.integration
def test_stopped_and_resumed_run_ends_bit_identical(tmp_path):
    cfg = _sim_config(6, 2, "inner.steps_per_round=25")
    # Pull the plug on everything in the middle of round 2, once its checkpoints are in.
    straight, resumed = straight_and_resumed(cfg, 2, tmp_path, step=2)
    assert resumed.report["events"]["restarts"] == 1
    assert resumed.report["checksum"] == straight.report["checksum"]
    assert set(resumed.report["islands"].values()) == {resumed.report["checksum"]}


@pytest.mark.integration
@pytest.mark.slow  # about 100 s on 2 cores; test_token_runs' chaos run (kills and restarts too) is in the default suite
def test_chaos_run_finishes_consistent_and_close_to_undisturbed(tmp_path):
    # Kills land right after a round's summary: with min_islands = every island no round closes while one
    # is down, so the schedule is in rounds, not seconds (a delay drawn in seconds let a fast run end first).
    rounds, islands = 12, 3
    cfg = _sim_config(rounds, islands, "inner.steps_per_round=80")
    calm = run_sim(cfg, islands, tmp_path / "calm", timeout_s=300, echo=lambda s: None)
    lines: list[str] = []
    result, chaos = run_chaos(
        cfg, islands, tmp_path / "chaos", ChaosPlan(island_every=3, coordinator_at=4, seed=1, kill_delay_s=(0.0, 0.05)), timeout_s=400, echo=lines.append
    )
    report = result.report
    who = [k[0] for k in chaos.kills]
    assert "coordinator" in who and sum(w.startswith("island") for w in who) >= 2, who
    assert [r["round"] for r in report["rounds"]] == list(range(rounds))
    # Every island ends with exactly the coordinator's global parameters.
    assert len(report["islands"]) == islands and set(report["islands"].values()) == {report["checksum"]}
    # No aggregate held part of a contribution: every folded contribution was whole.
    for r in report["rounds"]:
        assert r["elements_folded"] == r["elements_expected"] > 0, r
    assert report["events"]["restarts"] == 1
    # The summary counts each island that came back under its own id, and how long it was silent.
    assert report["events"]["island_restarts"] == len(who) - 1 and report["events"]["island_silent_s"] > 0
    final, calm_final = report["rounds"][-1]["eval_loss"], calm.report["rounds"][-1]["eval_loss"]
    assert abs(final - calm_final) / calm_final < 0.05, (final, calm_final)
    assert chaos.recovery_s, "no recovery was measured"


@pytest.mark.integration
@pytest.mark.parametrize(
    "text, message",
    [("0", "EVERY must be at least 1"), ("3:x", "is not EVERY[:COORDINATOR_AT] with whole numbers"), ("", "is not EVERY")],
)
def test_sim_with_a_bad_chaos_spec_exits_2_with_one_line(text, message):
    out = subprocess.run([sys.executable, "-m", "islands.sim", "--chaos", text], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-sim: error: --chaos: ") and message in lines[0], lines


@pytest.mark.integration
def test_sim_with_chaos_but_no_checkpoint_exits_2_saying_what_to_drop():
    out = subprocess.run([sys.executable, "-m", "islands.sim", "--chaos", "2", "--no-checkpoint"], capture_output=True,
                         text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines == ["diloco-sim: error: --chaos resumes from checkpoints; drop --no-checkpoint"]


@pytest.mark.unit
def test_parse_chaos():
    assert (parse_chaos("3:4").island_every, parse_chaos("3:4").coordinator_at) == (3, 4)
    assert parse_chaos("2").coordinator_at == -1  # the coordinator is left alone


@pytest.mark.integration
def test_a_spool_directory_the_coordinator_made_goes_when_it_stops_and_one_it_was_given_stays(tmp_path, monkeypatch):
    import tempfile

    from coordinator.server import start_coordinator

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where serve's own spool goes: TMPDIR
    cfg = one_island_config("wire.codec='e3m0'")  # a lossy downlink: its published copy is a file in the spool
    made = start_coordinator(cfg, "127.0.0.1", 0)
    assert len(list(tmp_path.glob("diloco-spool-*"))) == 1
    made.stop(0.5)
    assert list(tmp_path.glob("diloco-spool-*")) == []
    given = tmp_path / "given"
    start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(given)).stop(0.5)
    assert given.is_dir()
