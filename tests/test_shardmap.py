"""The coordinator's shard map (diloco/shardmap.py) and how a shard learns its place (coordinator/sharding.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from coordinator.launch import launcher_index, shard_secret
from coordinator.sharding import ShardRole
from diloco.config import ConfigError
from diloco.fragments import layout_for
from diloco.shardmap import ShardMap, join_checksums, split_checksum

pytestmark = pytest.mark.unit


def test_the_shard_map_cuts_every_fragment_at_parameter_boundaries_into_k_nonempty_runs():
    cfg = tiny_config("model.n_layers=3", "streaming.fragments=3", "inner.steps_per_round=3")
    names = {f"blocks.{b}.w{i}": 10 * (i + 1) for b in range(3) for i in range(4)} | {"embed.weight": 500, "norm.weight": 8}
    layout = layout_for(names, cfg)
    for k in (1, 2, 3):
        shard_map = ShardMap.of(layout, names, k)
        for fragment in layout:
            owners = [shard_map.owner[n] for n in fragment.names]
            assert owners == sorted(owners) and set(owners) == set(range(k))
    with pytest.raises(ConfigError, match="fewer than the coordinator's 9 shards"):
        ShardMap.of(layout, names, 9)


def test_a_shard_learns_its_place_from_torchrun_slurm_or_a_statefulset():
    assert launcher_index({"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert launcher_index({"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}) == (1, 3)
    assert launcher_index({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, hostname="diloco-coordinator-3") == (3, 0)
    assert launcher_index({}) is None
    with pytest.raises(ConfigError, match="DILOCO_SHARD_SECRET"):
        shard_secret({})
    assert shard_secret({"DILOCO_SHARD_SECRET": "ab" * 32}) == bytes.fromhex("ab" * 32)



def test_a_joined_checksum_splits_back_into_its_shards_parts():
    assert split_checksum(join_checksums(["a", "b", "c"]), 3) == ["a", "b", "c"]
    assert split_checksum("", 2) == ["", ""]
    assert join_checksums(["only"]) == "only"  # one shard: the one-process coordinator's checksum
    with pytest.raises(ValueError, match="2 parts for 3"):
        split_checksum("a+b", 3)


def test_shards_resume_from_the_newest_step_every_one_of_them_committed(tmp_path):
    from diloco.checkpoint import CheckpointStore

    role = ShardRole(1, ("a:1", "b:2", "c:3"), b"s" * 32)
    assert role.common_step(str(tmp_path), keep_last=3) is None  # a fresh run
    for shard, steps in enumerate([(1, 2, 3), (1, 2), (2, 3)]):
        store = CheckpointStore(ShardRole(shard, role.addresses, b"").checkpoint_url(str(tmp_path)), keep_last=3)
        for step in steps:
            store.save(step, {"x": torch.zeros(1)}, {"step": step})
    assert role.common_step(str(tmp_path), keep_last=3) == 2  # shard 1 never committed 3
    CheckpointStore(role.checkpoint_url(str(tmp_path)), keep_last=1).save(5, {"x": torch.zeros(1)}, {"step": 5})
    with pytest.raises(ValueError, match="share no committed checkpoint"):
        role.common_step(str(tmp_path), keep_last=3)


def test_shards_resume_only_from_a_step_they_committed_at_the_same_fragment_rounds(tmp_path):
    """A step number counts closes: a shard that came back behind and closed a round before it was rolled back wrote a
    step numbered like the other's at other rounds (the issue-42 team run). Resuming or exporting there would mix two
    states; the newest step at the same rounds is taken, and load_sharded refuses the mixed one."""
    from diloco.checkpoint import CheckpointStore
    from diloco.shardmap import load_sharded

    role = ShardRole(0, ("a:1", "b:2"), b"s" * 32)
    rounds = [{10: [5, 5], 11: [5, 6]}, {10: [5, 5], 11: [6, 5]}]
    for shard, steps in enumerate(rounds):
        store = CheckpointStore(ShardRole(shard, role.addresses, b"").checkpoint_url(str(tmp_path)), keep_last=3)
        for step, at in steps.items():
            store.save(step, {"outer_params": {f"p{shard}": torch.full((1,), float(step))}}, {"step": step, "fragment_rounds": at})
    assert role.common_step(str(tmp_path), keep_last=3) == 10
    step, tensors, _ = load_sharded(str(tmp_path), 2)
    assert step == 10 and {n: t.item() for n, t in tensors["outer_params"].items()} == {"p0": 10.0, "p1": 10.0}
    with pytest.raises(ValueError, match="at different rounds"):
        load_sharded(str(tmp_path), 2, step=11)


def _contribution_stats():
    """Six islands' pushes over six tensors (one 1,000x the rest: clipped; one pointing against them: dropped), and
    stats(keep): each contribution's statistics over the tensors keep(name) holds, as a shard sends its leader; with
    the tensors' owners among 3 shards."""
    import numpy as np

    from diloco.robust import Sketcher, add_exact
    from diloco.v1 import diloco_pb2 as pb

    rng = np.random.default_rng(0)
    names = [f"p{i}" for i in range(6)]
    honest = {n: rng.standard_normal(1000).astype(np.float32) for n in names}
    pushes = {f"island-{i}": {n: (v + 0.3 * rng.standard_normal(1000)).astype(np.float32) for n, v in honest.items()}
              for i in range(4)}
    pushes["island-4"] = {n: (1000 * v).astype(np.float32) for n, v in honest.items()}  # clipped
    pushes["island-5"] = {n: (-2.7 * v).astype(np.float32) for n, v in honest.items()}  # points against the rest
    sketcher, owner = Sketcher(b"k" * 16), {n: (0 if i < 2 else 1 if i < 5 else 2) for i, n in enumerate(names)}

    def stats(keep) -> list[pb.ContributionStats]:
        out = []
        for island, push in pushes.items():
            parts, sketch = [], Sketcher.empty()
            for n in names:
                if keep(n):
                    for lo in range(0, 1000, 256):  # chunks, as pushes arrive
                        add_exact(parts, float(np.dot(push[n][lo:lo + 256].astype(np.float64), push[n][lo:lo + 256])))
                        sketcher.add(sketch, n, lo, push[n][lo:lo + 256])
            out.append(pb.ContributionStats(key=island, sumsq_parts=parts, lr_sum=0.5, sketch=sketch.tobytes()))
        return out

    return stats, owner


def test_the_leader_judges_the_shards_parts_as_one_coordinator_judges_the_whole():
    """Norm clipping and the direction check on parts summed over shards give the one-process verdict, factors bit for
    bit: sums of squares are exact partials, sketches linear."""
    import math

    from coordinator.judging import judge_stats
    from diloco.config import RobustConfig
    from diloco.robust import NormGuard

    stats, owner = _contribution_stats()
    whole = judge_stats(NormGuard(RobustConfig()), [stats(lambda n: True)], "")
    sharded = judge_stats(NormGuard(RobustConfig()), [stats(lambda n, s=s: owner[n] == s) for s in range(3)], "")
    assert whole.clipped == ["island-4"] and whole.dropped == ["island-5"]
    assert (sharded.factors, sharded.clipped, sharded.dropped) == (whole.factors, whole.clipped, whole.dropped)
    assert sharded.reference == whole.reference and math.isfinite(whole.reference)


def test_a_contribution_missing_from_one_shards_part_is_dropped_on_every_shard_unjudged():
    """Whole on every shard or on none: a member that pushed to some shards only is dropped (factor 0) in the verdict
    every shard folds by, and the others are judged as if it had never pushed; a follower whose part reached the
    leader after it judged drops what that verdict does not name."""
    from coordinator.judging import judge_stats, unjudged_dropped
    from diloco.config import RobustConfig
    from diloco.robust import NormGuard, Verdict

    stats, owner = _contribution_stats()
    parts = [stats(lambda n, s=s: owner[n] == s) for s in range(3)]
    honest = judge_stats(NormGuard(RobustConfig()), [[c for c in p if c.key != "island-0"] for p in parts], "")
    parts[2] = [c for c in parts[2] if c.key != "island-0"]  # island-0 never pushed to shard 2
    verdict = judge_stats(NormGuard(RobustConfig()), parts, "")
    assert verdict.factors["island-0"] == 0.0 and "island-0" in verdict.dropped
    assert {k: f for k, f in verdict.factors.items() if k != "island-0"} == honest.factors
    assert verdict.reference == honest.reference
    late = unjudged_dropped(Verdict({"island-1": 1.0}), stats(lambda n: owner[n] == 1)[:2])
    assert late.factors == {"island-1": 1.0, "island-0": 0.0} and late.dropped == ["island-0"]


def test_a_shards_part_too_large_for_one_message_goes_in_pieces_and_is_judged_as_the_whole():
    """Six sketches (128 KiB each) exceed the leader's message limit: the follower cuts its part into pieces that fit,
    the leader answers all but the last at once and judges when every shard's last piece is in."""
    import threading

    from coordinator.judging import LeaderJudge, judge_stats, pieces_of
    from coordinator.limits import max_message_bytes
    from diloco.config import RobustConfig
    from diloco.robust import NormGuard
    from diloco.v1 import diloco_pb2 as pb

    stats, owner = _contribution_stats()
    parts = [stats(lambda n, s=s: owner[n] == s) for s in range(3)]
    limit = max_message_bytes(tiny_config())  # wire.chunk_bytes 4096: room for one sketch, not two
    pieces = pieces_of(parts[1], limit)
    assert len(pieces) == 6 and [c for p in pieces for c in p] == parts[1]
    assert all(pb.JudgeRequest(fragment=9, round=1 << 40, shard=3, proof="f" * 64, contributions=p, piece=i,
                               pieces=len(pieces)).ByteSize() <= limit for i, p in enumerate(pieces))
    assert pieces_of(parts[1], 1 << 30) == [parts[1]]

    leader = LeaderJudge(3, b"s" * 32, lambda f: (NormGuard(RobustConfig()), ""), wait_s=600)
    verdicts = {}

    def shard(s: int) -> None:
        verdicts[s] = leader.judge(0, 0, s, parts[s])

    others = [threading.Thread(target=shard, args=(s,)) for s in (0, 2)]
    for t in others:
        t.start()
    for i, piece in enumerate(pieces[:-1]):
        assert leader.judge(0, 0, 1, piece, i, len(pieces)) is None
    verdicts[1] = leader.judge(0, 0, 1, pieces[-1], len(pieces) - 1, len(pieces))
    for t in others:
        t.join(60)
    whole = judge_stats(NormGuard(RobustConfig()), [stats(lambda n: True)], "")
    assert whole.clipped == ["island-4"] and whole.dropped == ["island-5"]
    for s in range(3):
        assert (verdicts[s].factors, verdicts[s].clipped, verdicts[s].dropped) == (whole.factors, whole.clipped, whole.dropped)
    assert leader.pieces == {}


def test_a_shard_that_vanishes_after_some_of_its_pieces_leaves_the_round_judged_on_the_rest():
    """The leader waits for the missing pieces at most its wait, judges on the shards whose parts are whole, and
    keeps nothing of the half-sent part."""
    from coordinator.judging import LeaderJudge, judge_stats, pieces_of
    from coordinator.limits import max_message_bytes
    from diloco.config import RobustConfig
    from diloco.robust import NormGuard

    stats, owner = _contribution_stats()
    parts = [stats(lambda n, s=s: owner[n] < 2 if s == 0 else owner[n] == 2) for s in range(2)]
    pieces = pieces_of(parts[1], max_message_bytes(tiny_config()))
    leader = LeaderJudge(2, b"s" * 32, lambda f: (NormGuard(RobustConfig()), ""), wait_s=0.5)
    assert leader.judge(0, 0, 1, pieces[0], 0, len(pieces)) is None  # then shard 1 is gone
    verdict = leader.judge(0, 0, 0, parts[0])
    alone = judge_stats(NormGuard(RobustConfig()), [parts[0]], "")
    assert (verdict.factors, verdict.clipped, verdict.dropped) == (alone.factors, alone.clipped, alone.dropped)
    assert leader.pieces == {} and leader.parts == {}


def test_the_runs_report_counts_every_shards_refusals_and_joins_their_checksums():
    """A follower refuses its part of a push on its own (ROUND_AHEAD after its restart): the run's report counts it."""
    from coordinator.launch import merged_report

    leader = {"checksum": "a", "islands": {"east": "a"}, "events": {"refusals": {"NOT_LEASED": 1}, "late_pushes": 2}}
    follower = {"checksum": "b", "islands": {"east": "b"}, "events": {"refusals": {"ROUND_AHEAD": 3, "NOT_LEASED": 1}}}
    run = merged_report([leader, follower])
    assert run["events"] == {"refusals": {"NOT_LEASED": 2, "ROUND_AHEAD": 3}, "late_pushes": 2}
    assert run["checksum"] == "a+b" and run["islands"] == {"east": "a+b"}


def test_a_failure_found_on_the_islands_side_is_a_typed_error_not_a_key_error():
    """The shards staying at different rounds is found by the island, with no coordinator reason: it still makes one
    final error (before: KeyError: 0 from the status table, a traceback, and torchrun restarting the ranks)."""
    import grpc

    from diloco.wire.refusal import Reason
    from islands.client import LocalRefusal
    from islands.outcome import Next, next_step

    error = LocalRefusal(Reason.REASON_UNSPECIFIED, "the coordinator's shards stayed at different rounds")
    assert error.code() == grpc.StatusCode.UNKNOWN and next_step(error) is Next.FAIL
