"""Robust aggregation across a coordinator's shards (docs/sharding.md): one verdict per round, from every shard's part.

A contribution's norm is the square root of its elements' sum of squares, and
its direction sketch is linear in its elements, so both are sums over the
shards: each shard sends the leader, at its close, every contribution's exact
partial sums (diloco/robust.py add_exact) and partial sketch; the leader adds
them up, judges the round once with its guard (and its history), and answers
every shard the same factors. The norms are those the one-process coordinator
judges, bit for bit; the sketches' cosines agree to float64 rounding.

A shard's part goes in pieces where one request would exceed the leader's
message limit (coordinator/limits.py max_message_bytes): a sketch is 128 KiB a
contribution, so from about 16 islands a round at the default wire.chunk_bytes.

The shards close each round together, and a contribution is whole on every
shard or on none. The leader closes a round by its own rule (every live island
in, or the deadline) and tells each follower so, naming the islands it closed
with (CloseNotices, the CloseRound call); a follower then closes as soon as
those islands' parts are whole there too, never waiting for a member the leader
did not wait for (coordinator/rounds.py FragmentRounds._following_close_reason).
The verdict drops, on every shard, a contribution that some shard's part lacks
(a member that pushed to some shards only): folded on some shards only, it
would move part of the model by an update the rest never sees.

The leader waits for every shard's part at most rounds.deadline_s, then judges
on the parts it has (a shard that is down would otherwise stop the run); a
shard that cannot reach the leader for that long closes at its deadline and
judges its part alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from coordinator.gather import shard_channel
from coordinator.rounds import fold_key
from diloco.robust import NormGuard, Verdict
from diloco.security import shardproof
from diloco.security.credentials import TlsFiles
from diloco.shardmap import sign
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_KEPT_ROUNDS = 8  # verdicts kept per fragment for a shard that asks late (it restarted, or was slow)


def proof(secret: bytes, request: pb.JudgeRequest, now: float | None = None) -> str:
    """A following shard's proof for its Judge request to the leader: bound to the shard, to the request's fragment,
    round and statistics (its whole body), and to the time (diloco/security/shardproof.py)."""
    return shardproof.seal(secret, "judge", request.shard, 0, request, "proof", now)


def signed_request(secret: bytes, request: pb.JudgeRequest) -> pb.JudgeRequest:
    """request with a fresh proof: made again for each attempt, as a proof expires."""
    request.proof = proof(secret, request)
    return request


def stats_of(contributions) -> list[pb.ContributionStats]:
    """What a shard knows of a closing round's contributions (those trained on tokens: the guard judges only them),
    keyed as the verdict names them (rounds.fold_key)."""
    out = []
    for island, c in contributions:
        if not c.tokens:
            continue
        sketch = c.sketch.tobytes() if c.sketched and c.sketch is not None else b""
        out.append(pb.ContributionStats(key=fold_key(island, c), sumsq_parts=list(c.sumsq_parts), lr_sum=c.lr_sum,
                                        sketch=sketch))
    return out


_PIECE_SLACK = 4 << 10  # a request's own fields around its contributions
MAX_PIECES = 1 << 16  # more is not a shard's (a piece holds at least one contribution)


def pieces_of(stats: list[pb.ContributionStats], limit: int) -> list[list[pb.ContributionStats]]:
    """stats cut, in order, into pieces whose requests stay within limit bytes (one contribution a piece at the
    least: max_message_bytes leaves room for a sketch)."""
    pieces: list[list[pb.ContributionStats]] = [[]]
    size = _PIECE_SLACK
    for c in stats:
        n = c.ByteSize() + 8  # with its field tag and length
        if pieces[-1] and size + n > limit:
            pieces.append([])
            size = _PIECE_SLACK
        pieces[-1].append(c)
        size += n
    return pieces


def partial_keys(parts: list[list[pb.ContributionStats]]) -> list[str]:
    """The contributions some of these shards' parts hold and others do not: not whole, so folded on none."""
    keys = [{c.key for c in part} for part in parts]
    return sorted(set().union(*keys) - set.intersection(*keys)) if keys else []


def judge_stats(guard: NormGuard, parts: list[list[pb.ContributionStats]], label: str) -> Verdict:
    """The guard's verdict on every shard's statistics together (a contribution's parts summed over the shards).

    A contribution missing from some shard's part (a member that pushed to some shards only, or a push that did not
    arrive whole on one in time) is dropped on every shard, unjudged: folded on some shards only, it would move part
    of the model by an update the rest never sees."""
    partial = partial_keys(parts)
    if partial:
        log.warning("%s%s: contribution(s) not whole on every shard; dropped on all of them", label, ", ".join(partial))
    sums: dict[str, list[float]] = {}
    lrs: dict[str, float] = {}
    sketches: dict[str, np.ndarray | None] = {}
    for shard in parts:
        for c in shard:
            if c.key in partial:
                continue
            sums.setdefault(c.key, []).extend(c.sumsq_parts)
            lrs[c.key] = c.lr_sum
            mine = np.frombuffer(c.sketch, dtype=np.float64) if c.sketch else None
            if c.key not in sketches:
                sketches[c.key] = None if mine is None else mine.copy()
            elif sketches[c.key] is not None:
                sketches[c.key] = None if mine is None else sketches[c.key] + mine
    norms = {key: math.sqrt(math.fsum(s)) / lrs[key] for key, s in sums.items()}
    verdict = guard.judge(norms, label, {k: s for k, s in sketches.items() if s is not None})
    verdict.factors.update(dict.fromkeys(partial, 0.0))
    verdict.dropped.extend(partial)
    return verdict


def verdict_proto(v: Verdict) -> pb.JudgeResponse:
    return pb.JudgeResponse(factors=v.factors, clipped=v.clipped, dropped=v.dropped, reference=v.reference)


def verdict_of(r: pb.JudgeResponse) -> Verdict:
    return Verdict(dict(r.factors), list(r.clipped), list(r.dropped), r.reference)


class LeaderJudge:
    """On the leading shard: gathers each closing round's parts from every shard and judges it once."""

    def __init__(self, shards: int, secret: bytes, guard_of: Callable[[int], tuple[NormGuard, str]], wait_s: float):
        self.shards, self.secret, self.guard_of, self.wait_s = shards, secret, guard_of, wait_s
        self.cond = threading.Condition()
        self.parts: dict[tuple[int, int], dict[int, list[pb.ContributionStats]]] = {}
        self.pieces: dict[tuple[int, int, int], dict[int, list[pb.ContributionStats]]] = {}  # a shard's, as they come
        self.verdicts: dict[tuple[int, int], Verdict] = {}

    def refusal(self, request: pb.JudgeRequest) -> str | None:
        """Why the leader does not take this Judge request from a following shard (one line), or None when it does."""
        if not 0 < request.shard < self.shards:
            return f"shard {request.shard} is not a following shard of the {self.shards}"
        return shardproof.refusal(self.secret, "judge", request.shard, 0, request, "proof")

    def judge(self, fragment: int, round_: int, shard: int, stats: list[pb.ContributionStats], piece: int = 0,
              pieces: int = 1) -> Verdict | None:
        """The round's verdict, once every shard's part is in (or the wait is over); None for a piece of a shard's
        part that is not its last."""
        key = (fragment, round_)
        deadline = time.monotonic() + self.wait_s
        with self.cond:
            if pieces > 1 and key not in self.verdicts:
                got = self.pieces.setdefault((fragment, round_, shard), {})
                got[piece] = stats
                if len(got) < pieces:
                    return None
                del self.pieces[(fragment, round_, shard)]
                stats = [c for i in sorted(got) for c in got[i]]
            if key not in self.verdicts:
                self.parts.setdefault(key, {})[shard] = stats
                self.cond.notify_all()
                self.cond.wait_for(lambda: key in self.verdicts or len(self.parts.get(key, {})) == self.shards,
                                   max(0.0, deadline - time.monotonic()))
            if key not in self.verdicts:
                got = self.parts.pop(key, {})
                if len(got) < self.shards:
                    log.warning("fragment %d round %d: judged on %d of %d shards' statistics (the others did not send "
                                "theirs within %.0f s)", fragment, round_, len(got), self.shards, self.wait_s)
                guard, label = self.guard_of(fragment)
                self.verdicts[key] = judge_stats(guard, [got[s] for s in sorted(got)], label)
                for old in [k for k in self.verdicts if k[0] == fragment and k[1] <= round_ - _KEPT_ROUNDS]:
                    del self.verdicts[old]
                for old in [k for k in self.pieces if k[:2] == key]:  # a shard's part that came too late
                    del self.pieces[old]
                self.cond.notify_all()
            return self.verdicts[key]


def unjudged_dropped(verdict: Verdict, stats: list[pb.ContributionStats]) -> Verdict:
    """The leader's verdict on a following shard: a contribution of this shard's part that it does not name was not
    judged there (this part came after the leader judged without it), so it was folded on no other shard: dropped."""
    unjudged = [c.key for c in stats if c.key not in verdict.factors]
    verdict.factors.update(dict.fromkeys(unjudged, 0.0))
    verdict.dropped.extend(unjudged)
    return verdict


class FollowerJudge:
    """On a following shard: asks the leader for each closing round's verdict; judges alone if it cannot reach it."""

    def __init__(self, index: int, leader: str, secret: bytes, tls: TlsFiles | None, wait_s: float, message_bytes: int):
        self.index, self.secret, self.wait_s, self.message_bytes = index, secret, wait_s, message_bytes
        self.channel = shard_channel(leader, tls)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def judge(self, fragment: int, round_: int, stats: list[pb.ContributionStats], guard: NormGuard, label: str) -> Verdict:
        pieces = pieces_of(stats, self.message_bytes)
        requests = [pb.JudgeRequest(fragment=fragment, round=round_, shard=self.index, contributions=piece,
                                    piece=i, pieces=len(pieces)) for i, piece in enumerate(pieces)]
        deadline = time.monotonic() + 2 * self.wait_s  # the leader itself waits up to wait_s for the other shards
        delay = 0.2
        while True:
            try:
                for request in requests:  # all again after a failure: a restarted leader holds none of them
                    # An attempt waits less than a proof lives (a leader down that long gets a fresh one at the next).
                    timeout = max(1.0, min(deadline - time.monotonic(), shardproof.MAX_AGE_S / 2))
                    response = self.stub.Judge(signed_request(self.secret, request), timeout=timeout, wait_for_ready=True)
                verdict = unjudged_dropped(verdict_of(response), stats)
                guard.remember(verdict.reference)  # the history the leader's guard keeps: the first quorum ends here too
                return verdict
            except grpc.RpcError as e:
                # A refusal will not change on a retry (a message over the limit, a secret the leader does not share).
                final = e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED,
                                     grpc.StatusCode.INVALID_ARGUMENT)
                if final or time.monotonic() + delay > deadline:
                    log.error("fragment %d round %d: the leading shard did not judge the round (%s: %s); judging this "
                              "shard's part alone", fragment, round_, e.code().name, e.details())
                    return judge_stats(guard, [stats], label)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)

    def close(self) -> None:
        self.channel.close()


def close_proof(secret: bytes, shard: int, request: pb.CloseRoundRequest) -> str:
    """The leading shard's proof on its CloseRound call to following shard `shard` (diloco/security/shardproof.py)."""
    return shardproof.seal(secret, "close round", 0, shard, request, "proof")


def close_refusal(secret: bytes, shard: int, request: pb.CloseRoundRequest) -> str | None:
    """Why a CloseRound call is not the leading shard's to following shard `shard` (one line), or None when it is."""
    return shardproof.refusal(secret, "close round", 0, shard, request, "proof")


class CloseNotices:
    """On the leading shard: tells every following shard that a fragment's round closed here and with whose
    contributions (CloseRound), so that they close it with the same islands now rather than wait for members the
    leader did not wait for. Each notice is retried on its own thread until the follower took it, the round's
    verdict is made (the follower closed anyway), or wait_s passed."""

    def __init__(self, addresses: tuple[str, ...], secret: bytes, tls: TlsFiles | None, wait_s: float):
        self.secret, self.wait_s = secret, wait_s
        self.channels = [shard_channel(a, tls) for a in addresses[1:]]
        self.stubs = [pb_grpc.CoordinatorStub(c) for c in self.channels]
        self.last_sent: dict[int, int] = {}  # fragment -> the newest round this process sent a close of

    def sent(self, fragment: int, round_: int) -> bool:
        """Whether this process told the followers it closed fragment's round_ (or a later one)."""
        return round_ <= self.last_sent.get(fragment, -1)

    def send(self, fragment: int, round_: int, islands: list[str], settled: Callable[[], bool]) -> None:
        self.last_sent[fragment] = max(round_, self.last_sent.get(fragment, -1))
        for shard, stub in enumerate(self.stubs, start=1):
            request = pb.CloseRoundRequest(fragment=fragment, round=round_, islands=islands)
            threading.Thread(target=self._send, args=(stub, shard, request, settled), daemon=True,
                             name=f"close-notice-{shard}").start()

    def _send(self, stub, shard: int, request: pb.CloseRoundRequest, settled: Callable[[], bool]) -> None:
        deadline, delay = time.monotonic() + self.wait_s, 0.2
        while not settled():
            try:
                request.proof = close_proof(self.secret, shard, request)
                timeout = max(1.0, min(deadline - time.monotonic(), shardproof.MAX_AGE_S / 2))
                stub.CloseRound(request, timeout=timeout, wait_for_ready=True)
                return
            except grpc.RpcError as e:
                if time.monotonic() + delay > deadline:
                    log.warning("fragment %d round %d: shard %d did not take the leader's close (%s: %s); it closes the "
                                "round at its deadline", request.fragment, request.round, shard, e.code().name, e.details())
                    return
                time.sleep(delay)
                delay = min(2 * delay, 5.0)

    def roll_back(self, reason: str, timeout_s: float = 10.0) -> None:
        """Tells every follower to stop and resume from the shards' newest common checkpoint (coordinator/rollback.py);
        one that cannot be reached now is behind or down, and comes back through its own restart."""
        for shard, stub in enumerate(self.stubs, start=1):
            request = pb.CloseRoundRequest(roll_back=True, roll_back_reason=reason)
            request.proof = close_proof(self.secret, shard, request)
            try:
                stub.CloseRound(request, timeout=timeout_s, wait_for_ready=True)
            except grpc.RpcError as e:
                log.warning("shard %d did not take the roll-back (%s: %s)", shard, e.code().name, e.details())

    def close(self) -> None:
        for c in self.channels:
            c.close()


class ShardJudging:
    """A shard's part in judging: the round machines' judge hook, the sketches' shared keys, and (the leader) the
    verdicts its Judge calls answer with."""

    def __init__(self, index: int, addresses: tuple[str, ...], secret: bytes, tls: TlsFiles | None, wait_s: float,
                 fragments: Callable[[], list], message_bytes: int):
        self.sketch_secret = bytes.fromhex(sign(secret, "sketch"))[:16]
        self.leader: LeaderJudge | None = None
        self.notices: CloseNotices | None = None
        self.follower: FollowerJudge | None = None
        if index == 0:
            def guard_of(f: int) -> tuple[NormGuard, str]:
                rounds = fragments()[f]
                return rounds.guard, rounds.label

            self.leader = LeaderJudge(len(addresses), secret, guard_of, wait_s)
            self.notices = CloseNotices(addresses, secret, tls, wait_s)
        else:
            self.follower = FollowerJudge(index, addresses[0], secret, tls, wait_s, message_bytes)

    def __call__(self, rounds, closing) -> Verdict:
        """The verdict on a fragment's closing round (FragmentContext.judge)."""
        stats = stats_of(closing.contributions)
        if self.leader is not None:
            key = (rounds.index, rounds.round)
            on_time = [i for i, c in closing.contributions if not c.staleness]
            self.notices.send(*key, on_time, settled=lambda: key in self.leader.verdicts)
            return self.leader.judge(rounds.index, rounds.round, 0, stats)
        return self.follower.judge(rounds.index, rounds.round, stats, rounds.guard, rounds.label)

    def close(self) -> None:
        for part in (self.follower, self.notices):
            if part is not None:
                part.close()
