"""What a coordinator's shards show each other (diloco/security/shardproof.py): proofs bound to the caller, the
shard called, the request's body and the time, for a shard link someone captured.

Before: the leader's "leader reads" proof was an HMAC of a constant (it never expired and was bound to no caller),
and a Judge proof covered fragment, round and shard but not the statistics, so an old one replayed with a forged body
was accepted and clipped honest contributions.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest

from conftest import tiny_config
from test_sharded_coordinator import coordinator_of
from coordinator.gather import leader_reads, leader_reads_refusal
from coordinator.judging import proof
from diloco.security import shardproof
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.refusal import Reason, refusal_of

SECRET = os.urandom(32)


@pytest.mark.unit
def test_a_proof_holds_for_its_request_caller_and_time_only():
    request = pb.JudgeRequest(fragment=0, round=3, shard=1, contributions=[pb.ContributionStats(key="island-0", sumsq_parts=[1.0])])
    now = time.time()
    request.proof = proof(SECRET, request, now)
    assert shardproof.refusal(SECRET, "judge", 1, 0, request, "proof", now=now) is None
    forged = pb.JudgeRequest()
    forged.CopyFrom(request)
    forged.contributions[0].sumsq_parts[0] = 1e30  # the old proof over another body
    assert "not made for" in shardproof.refusal(SECRET, "judge", 1, 0, forged, "proof", now=now)
    later = pb.JudgeRequest()
    later.CopyFrom(request)
    later.round = 4  # another round
    assert shardproof.refusal(SECRET, "judge", 1, 0, later, "proof", now=now) is not None
    assert shardproof.refusal(SECRET, "judge", 2, 0, request, "proof", now=now) is not None  # another caller
    assert shardproof.refusal(SECRET, "leader reads", 1, 0, request, "proof", now=now) is not None  # another purpose
    assert shardproof.refusal(os.urandom(32), "judge", 1, 0, request, "proof", now=now) is not None  # another secret
    for skew in (shardproof.MAX_AGE_S + 1, -shardproof.MAX_AGE_S - 1):  # expired, or made ahead of the clock
        assert "expired" in shardproof.refusal(SECRET, "judge", 1, 0, request, "proof", now=now + skew)
    for garbage in ("", "f" * 64, "12:", ":abc", "x:" + "f" * 64):
        request.proof = garbage
        assert "no shard proof" in shardproof.refusal(SECRET, "judge", 1, 0, request, "proof", now=now)


@pytest.mark.unit
def test_the_leaders_reads_are_bound_to_the_shard_it_reads_the_request_and_the_time():
    watch = leader_reads(SECRET, 1, pb.WatchRequest(from_round=0))
    assert leader_reads_refusal(SECRET, 1, watch) is None
    assert leader_reads_refusal(SECRET, 2, watch) is not None  # shown to another follower
    replayed = pb.WatchRequest(from_round=5, shard_proof=watch.shard_proof)
    assert leader_reads_refusal(SECRET, 1, replayed) is not None
    fetch = pb.FetchRequest(shard_proof=watch.shard_proof)  # a watch's proof on a fetch
    assert leader_reads_refusal(SECRET, 1, fetch) is not None
    old = pb.FetchRequest()
    old.shard_proof = shardproof.seal(SECRET, "leader reads", 0, 1, old, "shard_proof", now=time.time() - 2 * shardproof.MAX_AGE_S)
    assert "expired" in leader_reads_refusal(SECRET, 1, old)


@pytest.mark.integration
def test_a_captured_judge_proof_neither_carries_a_forged_body_nor_outlives_its_time(tmp_path):
    cfg = tiny_config()
    honest = [pb.ContributionStats(key="island-0", sumsq_parts=[1.0], lr_sum=1.0)]
    forged = [pb.ContributionStats(key="island-0", sumsq_parts=[1e30], lr_sum=1.0)]
    with coordinator_of(cfg, 2, tmp_path) as (leader, _):
        judge = leader.shard_services.judging.leader
        captured = pb.JudgeRequest(fragment=0, round=0, shard=1, contributions=honest)
        captured.proof = proof(judge.secret, captured)  # what the follower sent, seen on its link
        replayed = pb.JudgeRequest(fragment=0, round=0, shard=1, contributions=forged, proof=captured.proof)
        expired = pb.JudgeRequest(fragment=0, round=0, shard=1, contributions=honest)
        expired.proof = proof(judge.secret, expired, time.time() - 2 * shardproof.MAX_AGE_S)
        for request, why in ((replayed, "not made for"), (expired, "expired")):
            with grpc.insecure_channel(f"127.0.0.1:{leader.port}") as channel, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(channel).Judge(request, timeout=30)
            assert refusal_of(refused.value).reason == Reason.NOT_YOURS and why in refused.value.details()
        assert not judge.parts and not judge.verdicts and not judge.pieces


@pytest.mark.integration
def test_only_the_leaders_signed_close_reaches_a_follower(tmp_path):
    """CloseRound makes a follower close a round without the islands it did not name: only the leading shard may call
    it, signed for that follower and that body; the leader itself and a one-process coordinator take none."""
    from coordinator.judging import close_proof

    cfg = tiny_config()
    with coordinator_of(cfg, 2, tmp_path / "k2") as (leader, follower), coordinator_of(cfg, 0, tmp_path / "k0") as (alone,):
        secret = leader.shard_services.judging.leader.secret
        good = pb.CloseRoundRequest(fragment=0, round=0, islands=["island-0"])
        good.proof = close_proof(secret, 1, good)
        widened = pb.CloseRoundRequest(fragment=0, round=0, islands=[], proof=good.proof)  # the captured proof, another body
        to_shard_2 = pb.CloseRoundRequest(fragment=0, round=0, islands=["island-0"])
        to_shard_2.proof = close_proof(secret, 2, to_shard_2)
        # A roll-back (every shard stops to resume together) under a captured close's proof, or none.
        roll_back = pb.CloseRoundRequest(fragment=0, round=0, islands=["island-0"], roll_back=True, proof=good.proof)
        for target, request in ((follower, widened), (follower, to_shard_2), (follower, pb.CloseRoundRequest()),
                                (follower, roll_back), (follower, pb.CloseRoundRequest(roll_back=True)),
                                (leader, good), (alone, good)):
            with grpc.insecure_channel(f"127.0.0.1:{target.port}") as channel, pytest.raises(grpc.RpcError) as refused:
                # wait_for_ready: the leader's own channel to the follower, opened before it listened, may be in backoff
                pb_grpc.CoordinatorStub(channel).CloseRound(request, timeout=30, wait_for_ready=True)
            assert refusal_of(refused.value).reason == Reason.NOT_YOURS
        assert follower.state.fragments[0].leader_close is None
        assert not follower.shard_services.rollback.requested.is_set()
        with grpc.insecure_channel(f"127.0.0.1:{follower.port}") as channel:
            pb_grpc.CoordinatorStub(channel).CloseRound(good, timeout=30, wait_for_ready=True)
        assert follower.state.fragments[0].leader_close.islands == {"island-0"}
