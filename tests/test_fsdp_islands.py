"""Sharded islands: R replica groups x N FSDP ranks kept in step by torchft, each rank exchanging its own shard.

The multi-process runs live in tests/fsdp_scenarios.py and are started here
inside a user + network namespace that has only loopback (`unshare -rn`),
because torchft's manager and checkpoint server bind every interface. Each
scenario bounds all its waits and kills what it started; the test adds an
outer timeout on top.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PER_STEP as PUPPET, run_scenario  # the puppet island pushes one honest step a round
from kit import assemble_shards, assert_equals_coordinator, assert_every_round_whole
from islands.cli import build_parser
from islands.launch import LaunchError, LaunchOptions, adopt_slurm_env, replica_spec, worker_command

ROOT = Path(__file__).resolve().parents[1]


def _scenario(name: str, workdir: Path, timeout_s: float) -> dict:
    return run_scenario("fsdp_scenarios.py", name, workdir, timeout_s)


def _events(reports: Path, tag: str) -> list[dict]:
    path = reports / f"{tag}.events"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- a 2 x 2 island and a 1-rank island in one run --------------------------------------------


@pytest.fixture(scope="module")
def two_islands(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two_islands")
    return workdir, _scenario("two_islands", workdir, timeout_s=240)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sharded_and_single_islands_end_holding_the_coordinators_parameters(two_islands):
    workdir, result = two_islands
    assert result["notes"]["exit_codes"] == {"sharded": 0, "single": 0}
    assert result["final_round"] == 4
    assert_every_round_whole(result, islands=2)
    # Both islands left reporting exactly the coordinator's checksum (the sharded one after every
    # rank of every group verified its ranges against the coordinator's checksum of them).
    assert set(result["islands"].values()) == {result["checksum"]}
    coordinator = torch.load(workdir / "coordinator.pt")
    for group in (0, 1):
        for key in ("model", "global"):
            assert_equals_coordinator(assemble_shards(workdir / "sharded", group, 0, 2, key), coordinator, f"group {group} {key}")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_outer_step_memory_per_rank_stays_far_below_the_full_model(two_islands):
    workdir, _ = two_islands
    figures = []
    for report in sorted((workdir / "sharded").glob("*.json")):
        r = json.loads(report.read_text())
        assert len(r["memory"]) == 4, f"{report.name}: no measurement for every outer step"
        peak = max(m["peak_rss_bytes"] for m in r["memory"])
        figures.append((report.stem, peak, r["shard_fp32_bytes"], r["full_model_fp32_bytes"]))
        # The model is a few MB so that holding it, or even one shard, would show.
        assert r["full_model_fp32_bytes"] > 6_000_000
        assert peak < r["shard_fp32_bytes"] / 2, figures[-1]
        assert peak < r["full_model_fp32_bytes"] / 4, figures[-1]
    print("\nouter-step peak RSS growth per rank (bytes): " + ", ".join(f"{t}={p} (shard {s}, model {f})" for t, p, s, f in figures))


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_time_boxed_streaming_rounds_keep_every_group_and_rank_on_one_step(tmp_path):
    """rounds.mode = "time" with P = 2, tau = 1: the groups agree on the round's clock through their gradient
    all-reduce, so every rank of both groups syncs each fragment at the same step; the sharded island, unthrottled,
    trains more steps than the throttled one; everyone ends on the coordinator's parameters."""
    result = _scenario("time_boxed", tmp_path, timeout_s=240)
    assert result["notes"]["exit_codes"] == {"sharded": 0, "single": 0}
    assert result["final_round"] == 4
    assert_every_round_whole(result, islands=2)
    assert set(result["islands"].values()) == {result["checksum"]}
    reports, coordinator = tmp_path / "sharded", torch.load(tmp_path / "coordinator.pt")
    syncs = set()
    for group in (0, 1):
        assert_equals_coordinator(assemble_shards(reports, group, 0, 2, "global"), coordinator, f"group {group}")
        for rank in (0, 1):
            exchanges = [(e["fragment"], e["round"], e["pushed_step"]) for e in _events(reports, f"g{group}-r{rank}-a0")
                         if e["event"] == "exchange"]
            assert len(exchanges) == 8, exchanges  # 2 fragments x 4 rounds
            syncs.add(tuple(exchanges))
    assert len(syncs) == 1, f"groups or ranks synced at different steps: {syncs}"
    steps = {i: s["inner_steps"] for i, s in result["island_stats"].items()}
    assert len(steps) == 2 and max(steps.values()) > min(steps.values()), steps


# --- SIGKILL of a replica group; the pushing group dying mid-push ------------------------------


def _restarted(reports: Path, group: int) -> int:
    """The attempt of a restarted group that ran to the end (torchrun counts restarts from 0)."""
    finished = [int(p.stem.rsplit("-a", 1)[1]) for p in reports.glob(f"g{group}-r0-a*.json")]
    assert finished and max(finished) >= 1, f"group {group} never came back after its failure"
    return max(finished)


def _heal_matches_peer(reports: Path, healed_tag: str, peer_tags: list[str]) -> dict:
    """The state a group healed into equals its peer's at the same torchft step (model, theta_global, optimizer)."""
    healed = [e for e in _events(reports, healed_tag) if e["event"] == "step" and e["healed"]]
    assert healed, f"{healed_tag} never healed"
    first = healed[0]
    peer = [e for tag in peer_tags for e in _events(reports, tag) if e["event"] == "step" and e["step"] == first["step"]]
    assert peer, f"no peer step {first['step']} to compare {healed_tag} with"
    for key in ("round", "pos", "model", "globals", "optimizer"):
        assert first[key] == peer[0][key], (key, first, peer[0])
    return first


@pytest.mark.integration
@pytest.mark.timeout(300)
# On tokens outside the default suite for its time (about 50 s): test_token_runs kills islands on tokens there.
@pytest.mark.parametrize("data", ["synthetic", pytest.param("tokens", marks=pytest.mark.slow)])
def test_killed_replica_group_heals_and_a_dead_pusher_is_taken_over(tmp_path, data):
    if data == "tokens":
        from kit import write_corpus

        result = run_scenario("fsdp_scenarios.py", "faults", tmp_path, 260, write_corpus(tmp_path / "corpus", docs=300))
        # Each round folded exactly the island's leased positions it names (the puppet adds one honest step's tokens
        # and no samples), and no position twice: group 1's death and both heals kept the data cursor exact.
        folded = []
        for r in result["rounds"]:
            assert r["data"]["folded_this_round"] == r["tokens"] - PUPPET > 0, r
            folded += [p for a, b in r["data"]["samples"] for p in range(a, b)]
        assert len(folded) == len(set(folded)) and result["data"]["tokens_repeated"] == 0
    else:
        result = _scenario("faults", tmp_path, timeout_s=260)
    reports, notes = tmp_path / "sharded", result["notes"]
    assert notes["exit_codes"] == {"sharded": 0} and notes["killed"]["round"] == 1
    # Every round completed with the sharded island's whole contribution, through both failures.
    assert_every_round_whole(result, islands=2)
    sharded = notes["sharded_island"]
    assert all(sharded in r["islands"] for r in result["rounds"])
    # While group 1 was down the island kept training: group 0 trained (some of) round 2 alone.
    tokens = [r["tokens"] - PUPPET for r in result["rounds"]]  # the puppet adds one step's tokens a round
    assert tokens[2] < tokens[0], tokens
    # The restarted groups healed from their live peer, rank k from rank k, and then held exactly its state.
    g0, g1 = _restarted(reports, 0), _restarted(reports, 1)
    for rank in (0, 1):
        _heal_matches_peer(reports, f"g1-r{rank}-a{g1}", [f"g0-r{rank}-a0"])
        _heal_matches_peer(reports, f"g0-r{rank}-a{g0}", [f"g1-r{rank}-a{g1}"])
    # In round 3 group 0's rank 1 died before pushing, after rank 0 had delivered its shard: at the
    # landing nobody reported the push, so the group that was then rank 0 of the quorum (group 1, or
    # group 0 restarted and healed, whichever torchft ranks first) took it over, every rank its own
    # shard; the shard already there counted as delivered (round 3 is whole, above).
    takeovers = [(path.stem, e) for path in sorted(reports.glob("*.events")) for e in _events(reports, path.stem)
                 if e["event"] == "takeover"]
    assert [e["round"] for _, e in takeovers] == [3, 3], takeovers
    assert len({tag.split("-")[0] for tag, _ in takeovers}) == 1 and {tag.split("-")[1] for tag, _ in takeovers} == {"r0", "r1"}
    # In the end both groups hold exactly the coordinator's global parameters.
    coordinator = torch.load(tmp_path / "coordinator.pt")
    for group, attempt in ((0, g0), (1, g1)):
        assert_equals_coordinator(assemble_shards(reports, group, attempt, 2), coordinator, f"group {group}")


# --- started by a plain torchrun; the launcher's flags -------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(200)
def test_island_started_by_a_plain_torchrun(tmp_path):
    result = _scenario("torchrun", tmp_path, timeout_s=170)
    assert result["notes"]["exit_codes"] == {"torchrun": 0}
    assert_every_round_whole(result, islands=1)
    assert set(result["islands"].values()) == {result["checksum"]}
    assert_equals_coordinator(assemble_shards(tmp_path / "torchrun", 0, 0, 2), torch.load(tmp_path / "coordinator.pt"), "torchrun island")
    # Every rank kept its top-k residual in its shard after rounds 0 and 1, and ended on theta_global.
    for rank in (0, 1):
        carried = [e["carried"] for e in _events(tmp_path / "torchrun", f"g0-r{rank}-a0") if e["event"] == "exchange"]
        assert len(carried) == 3 and carried[0] > 0 and carried[1] > 0 and carried[2] == 0, carried


@pytest.mark.unit
def test_launcher_runs_each_replica_group_through_torchrun():
    cmd = worker_command(["join", "--coordinator", "h:1"], LaunchOptions(nproc_per_node=4, replica_groups=2, max_restarts=5))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=4" in cmd and "--max-restarts=5" in cmd
    assert cmd[-5:] == ["-m", "islands", "join", "--coordinator", "h:1"]
    args = build_parser().parse_args(["join", "--coordinator", "h:1", "--nproc-per-node", "2", "--replica-groups", "3"])
    assert (args.nproc_per_node, args.replica_groups, args.max_restarts) == (2, 3, 3)


@pytest.mark.unit
def test_rank_environment_from_torchrun_and_slurm():
    args = build_parser().parse_args(["join", "--coordinator", "h:1"])
    env = {"RANK": "1", "WORLD_SIZE": "2", "DILOCO_REPLICA_GROUP": "1", "DILOCO_REPLICA_GROUPS": "2",
           "TORCHFT_LIGHTHOUSE": "http://10.0.0.1:29510"}
    spec = replica_spec(args, env)
    assert (spec.group, spec.groups, spec.ft.lighthouse) == (1, 2, "http://10.0.0.1:29510")
    assert spec.key == "lighthouse-http://10.0.0.1:29510", "groups of one island must share a key without being told one"
    with pytest.raises(LaunchError, match="need a torchft lighthouse"):
        replica_spec(args, {"DILOCO_REPLICA_GROUPS": "2"})
    with pytest.raises(LaunchError, match="outside"):
        replica_spec(args, {"DILOCO_REPLICA_GROUP": "2", "DILOCO_REPLICA_GROUPS": "2", "TORCHFT_LIGHTHOUSE": "http://x:1"})
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    assert adopt_slurm_env(slurm)
    assert (slurm["RANK"], slurm["WORLD_SIZE"], slurm["LOCAL_RANK"], slurm["DILOCO_ISLAND_KEY"]) == ("3", "4", "1", "slurm-77")
    assert not adopt_slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}), "a one-task srun is a one-rank island"
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        adopt_slurm_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


@pytest.mark.integration
@pytest.mark.parametrize(
    "argv, env, message",
    [
        ([], {"RANK": "0", "WORLD_SIZE": "1", "DILOCO_REPLICA_GROUPS": "2"}, "need a torchft lighthouse"),
        ([], {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR"),
        (["--nproc-per-node", "2", "--compile"], {}, "--compile is for one-rank islands"),
    ],
    ids=["torchrun-without-lighthouse", "slurm-without-master", "compile-sharded"],
)
def test_bad_launches_are_one_line_errors(argv, env, message):
    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM", "DILOCO", "TORCHFT"))}
    out = subprocess.run(
        [sys.executable, "-m", "islands", "join", "--coordinator", "127.0.0.1:9", *argv],
        env={**clean, **env}, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr


# --- against a coordinator of several shards ------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(500)
def test_an_fsdp_island_against_three_coordinator_shards_ends_as_against_one_process(tmp_path):
    """A 1 x 2 FSDP island (ranges cut mid-parameter) and a 1-rank island, 4-bit pushes: three coordinator shards
    (cut at parameter boundaries) end on the one-process coordinator's parameters and momentum, bit for bit."""
    one = run_scenario("fsdp_scenarios.py", "sharded_coordinator", tmp_path / "one", 220, "0")
    three = run_scenario("fsdp_scenarios.py", "sharded_coordinator", tmp_path / "three", 220, "3")
    for result in (one, three):
        assert result["notes"]["exit_codes"] == {"sharded": 0, "single": 0}
        assert set(result["islands"].values()) == {result["checksum"]}, "an island left on other parameters"
    for name in ("coordinator.pt", "momentum.pt"):
        expected, got = torch.load(tmp_path / "one" / name), torch.load(tmp_path / "three" / name)
        assert expected.keys() == got.keys()
        for key, t in expected.items():
            assert torch.equal(got[key], t), f"{name}: {key} differs with three shards"
    # Each FSDP rank verified its ranges against every shard and ended on the coordinator's parameters.
    assert_equals_coordinator(assemble_shards(tmp_path / "three" / "sharded", 0, 0, 2), torch.load(tmp_path / "three" / "coordinator.pt"),
                              "the FSDP island")
    # One checksum for the run (its shards' joined), logged alike by every rank of either island.
    logged = [said for name in ("sharded", "single")
              for said in re.findall(r"parameters checksum (\S*) \(", (tmp_path / "three" / f"{name}.log").read_text())]
    assert logged == [three["checksum"]] * 3 and three["checksum"].count("+") == 2, (logged, three["checksum"])
