"""The whole run on a coordinator's leading shard: the whole model for its evaluation, every shard's figures for
its round summaries (docs/sharding.md).

No shard holds the whole model. When the leader evaluates (eval.every_rounds),
it reads every following shard's published values for the same fragment rounds
as its own (FetchParameters, signed with the shards' secret) and evaluates them
all together; the copy lives only while the evaluation runs. A follower that has
not reached those rounds within wait_s (or has gone past them) leaves that
evaluation out (NaN, logged) rather than measure a model no island held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
import torch

from diloco.security import shardproof
from diloco.security.credentials import TlsFiles
from diloco.shardmap import join_checksums
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.codec import get_codec
from diloco.wire.frames import ResultRest, stub_for
from diloco.wire.messages import Manifest, apply_chunks

log = logging.getLogger(__name__)


def leader_reads(secret: bytes, shard: int, request: pb.FetchRequest | pb.WatchRequest) -> pb.FetchRequest | pb.WatchRequest:
    """request with what the leading shard shows following shard `shard` to read its values or watch its rounds (what
    every member may read already, and no island's to change): a proof bound to the leader, that shard, the request and
    the time (diloco/security/shardproof.py), made for each call."""
    request.shard_proof = shardproof.seal(secret, "leader reads", 0, shard, request, "shard_proof")
    return request


def leader_reads_refusal(secret: bytes, shard: int, request: pb.FetchRequest | pb.WatchRequest) -> str | None:
    """Why request is not the leading shard's read of following shard `shard` (one line), or None when it is."""
    return shardproof.refusal(secret, "leader reads", 0, shard, request, "shard_proof")


class WholeModel:
    """Reads the following shards' parts (manifests: each follower's, in shard order from shard 1)."""

    def __init__(self, addresses: tuple[str, ...], secret: bytes, tls: TlsFiles | None, manifests: list[Manifest],
                 wait_s: float = 60.0):
        self.secret, self.manifests, self.wait_s = secret, manifests, wait_s
        self.channels = [shard_channel(a, tls) for a in addresses[1:]]
        self.stubs = [stub_for(c) for c in self.channels]

    def gather(self, own: dict[str, torch.Tensor], rounds: list[int]) -> dict[str, torch.Tensor] | None:
        """own with every follower's values at these fragment rounds; None when one could not give them."""
        whole = dict(own)
        for shard, (stub, manifest) in enumerate(zip(self.stubs, self.manifests), start=1):
            part = self._part(stub, manifest, rounds, shard)
            if part is None:
                return None
            whole.update(part)
        return whole

    def _part(self, stub, manifest: Manifest, rounds: list[int], shard: int) -> dict[str, torch.Tensor] | None:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                targets = {n: torch.empty(s) for n, s in manifest.shapes.items()}
                got = self._fetch(stub, targets, manifest, shard)
                if got == rounds:
                    return targets
                if any(g > r for g, r in zip(got, rounds)):
                    log.warning("evaluation left out: shard %d is at fragment rounds %s, past %s", shard, got, rounds)
                    return None
            except (grpc.RpcError, ValueError) as e:  # down or restarting: it may come back within wait_s
                got = f"unreachable ({e})"
            if time.monotonic() > deadline:
                log.warning("evaluation left out: shard %d did not reach fragment rounds %s within %.0f s (it is %s)",
                            shard, rounds, self.wait_s, got)
                return None
            time.sleep(0.1)

    def _fetch(self, stub, targets: dict[str, torch.Tensor], manifest: Manifest, shard: int) -> list[int]:
        stream = stub.FetchParameters(leader_reads(self.secret, shard, pb.FetchRequest()), timeout=max(30.0, self.wait_s),
                                      wait_for_ready=True)
        header = next(stream).header
        rest = ResultRest(stream, lambda n: None)
        written = apply_chunks(rest, targets, manifest, get_codec("fp32"))
        rest.complete(header)
        if written != manifest.total_numel():
            raise ValueError(f"its values ended early ({written} of {manifest.total_numel()} elements)")
        return [f.round for f in header.fragments] or [header.round]

    def evaluating(self, evaluate: Callable | None, rounds: Callable[[], list[int]], missing,
                   initial: Callable[[], dict[str, torch.Tensor]], ready: Callable[[], bool]):
        """evaluate over the whole model (None without one): at these fragment rounds once ready(), before that (the
        state evaluating its initial parameters) on initial(); `missing` for a round whose parts could not be read."""
        if evaluate is None:
            return None

        def run(own: dict[str, torch.Tensor]):
            if not ready():
                return evaluate(initial())
            whole = self.gather(own, rounds())
            return evaluate(whole) if whole is not None else missing

        return run

    def close(self) -> None:
        for c in self.channels:
            c.close()


class FollowerRounds:
    """The following shards' round summaries, watched from the leader (WatchRounds, signed with the shards' secret),
    so that the leader's summary of each round is the run's: every shard's bytes and traffic added, the slowest
    shard's seconds, the shards' checksums joined; and a row per shard for the dashboard and /metrics."""

    def __init__(self, addresses: tuple[str, ...], secret: bytes, tls: TlsFiles | None, wait_s: float = 10.0,
                 decided: Callable[[int, int], bool] = lambda f, r: True, apart: Callable[[str], None] = lambda why: None):
        """decided(f, r): whether the leader closed (or is closing) fragment f's round r; apart(why): the shards no
        longer hold one run (coordinator/rollback.py)."""
        self.addresses, self.wait_s = addresses, wait_s
        self.secret, self.decided, self.apart = secret, decided, apart
        self.cond = threading.Condition()
        self.got: dict[tuple[int, int], dict[int, pb.RoundSummary]] = {}  # (fragment, round) -> shard -> summary
        self.rounds: dict[int, dict[int, int]] = {}  # each follower's fragments' rounds now (the last closed + 1)
        self.bytes: dict[int, list[int]] = {0: [0, 0]}  # each shard's bytes [up, down] over the run (0: the leader's)
        self.stop = threading.Event()
        self.channels = [shard_channel(a, tls) for a in addresses[1:]]
        self.threads = [threading.Thread(target=self._watch, args=(shard, channel, secret), name=f"watch-shard-{shard}",
                                         daemon=True) for shard, channel in enumerate(self.channels, start=1)]

    def start(self) -> FollowerRounds:
        """Watches the followers; once the leader's state is restored (decided reads its rounds)."""
        for t in self.threads:
            t.start()
        return self

    def _watch(self, shard: int, channel: grpc.Channel, secret: bytes) -> None:
        stub, seen, again = pb_grpc.CoordinatorStub(channel), set(), False
        while not self.stop.is_set():  # a follower restarting: watch again (a fresh proof), skipping what came already
            try:
                if again:
                    self._came_back(shard, stub)
                again = True
                for s in stub.WatchRounds(leader_reads(secret, shard, pb.WatchRequest(from_round=0)), wait_for_ready=True):
                    if (s.fragment, s.round) in seen:
                        continue
                    seen.add((s.fragment, s.round))
                    if not self.decided(s.fragment, s.round):
                        self.apart(f"coordinator shard {shard} closed fragment {s.fragment}'s round {s.round}, which this "
                                   "leading shard has not (it resumed from an older checkpoint)")
                    with self.cond:
                        self.got.setdefault((s.fragment, s.round), {})[shard] = s
                        self.rounds.setdefault(shard, {})[s.fragment] = s.round + 1
                        totals = self.bytes.setdefault(shard, [0, 0])
                        totals[0] += s.bytes_up
                        totals[1] += s.bytes_down
                        self.cond.notify_all()
                    if s.run_finished:
                        return
            except grpc.RpcError:
                self.stop.wait(1.0)

    def _came_back(self, shard: int, stub) -> None:
        """A follower reached again (it may have restarted): if it is now behind a round it had closed, it lost a round
        the islands hold (killed between that close and its checkpoint)."""
        stream = stub.FetchParameters(leader_reads(self.secret, shard, pb.FetchRequest()), timeout=30.0, wait_for_ready=True)
        try:
            header = next(stream).header
        finally:
            stream.cancel()  # the rounds are in the header; the values are not needed
        now = {f.index: f.round for f in header.fragments} or {0: header.round}
        with self.cond:
            closed = dict(self.rounds.get(shard, {}))
        lost = {f: r for f, r in closed.items() if now.get(f, r) < r}
        if lost:
            self.apart(f"coordinator shard {shard} came back at fragment rounds {now}, behind rounds it had closed and the "
                       f"islands hold ({closed})")

    def merge(self, summary: pb.RoundSummary) -> None:
        """Adds the other shards' part of the round to the leader's summary (waiting up to wait_s for them)."""
        key, others = (summary.fragment, summary.round), len(self.addresses) - 1
        with self.cond:
            self.cond.wait_for(lambda: len(self.got.get(key, {})) == others or self.stop.is_set(), self.wait_s)
            parts = self.got.pop(key, {})
            for old in [k for k in self.got if k[0] == summary.fragment and k[1] < summary.round]:  # never merged
                del self.got[old]
            self.bytes[0][0] += summary.bytes_up
            self.bytes[0][1] += summary.bytes_down
        if len(parts) < others:
            log.warning("round %d's summary has %d of %d shards' figures (the others' did not come within %.0f s)",
                        summary.round, len(parts) + 1, others + 1, self.wait_s)
        checksums = [summary.checksum] + [parts[i].checksum if i in parts else "" for i in range(1, others + 1)]
        traffic = {t.island_id: [t.bytes_up, t.bytes_down] for t in summary.traffic}
        for p in parts.values():
            summary.bytes_up += p.bytes_up
            summary.bytes_down += p.bytes_down
            summary.ddp_bytes += p.ddp_bytes
            summary.elements_folded += p.elements_folded
            summary.elements_expected += p.elements_expected
            for name in ("seconds", "fold_s", "step_s", "publish_s"):
                setattr(summary, name, max(getattr(summary, name), getattr(p, name)))
            for t in p.traffic:
                both = traffic.setdefault(t.island_id, [0, 0])
                both[0] += t.bytes_up
                both[1] += t.bytes_down
        del summary.traffic[:]
        summary.traffic.extend(pb.IslandTraffic(island_id=i, bytes_up=u, bytes_down=d) for i, (u, d) in traffic.items())
        summary.checksum = join_checksums(checksums)

    def rows(self, leader_round: int) -> list[dict]:
        """One row per shard, the leader's (at leader_round) first: its address, its round (a follower's slowest
        fragment's, as far as the leader has seen them close) and the bytes it carried."""
        with self.cond:
            rounds = {0: leader_round} | {s: min(r.values()) for s, r in self.rounds.items()}
            return [{"shard": shard, "address": address, "round": rounds.get(shard),
                     "bytes_up": self.bytes.get(shard, [0, 0])[0], "bytes_down": self.bytes.get(shard, [0, 0])[1]}
                    for shard, address in enumerate(self.addresses)]

    def close(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        for c in self.channels:
            c.close()


def shard_channel(address: str, tls: TlsFiles | None) -> grpc.Channel:
    """A shard's channel to another: mutual TLS with the coordinator's own certificate (it allows client use), or
    plaintext where the shards serve plaintext."""
    # A shard restarting is reached again within 2 s of its return (gRPC's own backoff grows to 120 s).
    options = [("grpc.initial_reconnect_backoff_ms", 1000), ("grpc.max_reconnect_backoff_ms", 2000)]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    ca, cert, key = tls.read()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=options)
