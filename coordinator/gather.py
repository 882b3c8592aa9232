"""The whole model on a coordinator's leading shard, for its evaluation (docs/sharding.md).

No shard holds the whole model. When the leader evaluates (eval.every_rounds),
it reads every following shard's published values for the same fragment rounds
as its own (FetchParameters, signed with the shards' secret) and evaluates them
all together; the copy lives only while the evaluation runs. A follower that has
not reached those rounds within wait_s (or has gone past them) leaves that
evaluation out (NaN, logged) rather than measure a model no island held.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable

import grpc
import torch

from diloco.security.credentials import TlsFiles
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.codec import get_codec
from diloco.wire.frames import ResultRest, stub_for
from diloco.wire.messages import Manifest, apply_chunks

log = logging.getLogger(__name__)


def fetch_proof(secret: bytes) -> str:
    """What a leading shard shows a following one to read its values (they are what every member holds already)."""
    return hmac.new(secret, b"fetch", hashlib.sha256).hexdigest()


class WholeModel:
    """Reads the following shards' parts (manifests: each follower's, in shard order from shard 1)."""

    def __init__(self, addresses: tuple[str, ...], secret: bytes, tls: TlsFiles | None, manifests: list[Manifest],
                 wait_s: float = 60.0):
        self.proof, self.manifests, self.wait_s = fetch_proof(secret), manifests, wait_s
        if tls is not None:
            ca, cert, key = tls.read()
            self.channels = [grpc.secure_channel(a, grpc.ssl_channel_credentials(ca, key, cert)) for a in addresses[1:]]
        else:
            self.channels = [grpc.insecure_channel(a) for a in addresses[1:]]
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
                got = self._fetch(stub, targets, manifest)
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

    def _fetch(self, stub, targets: dict[str, torch.Tensor], manifest: Manifest) -> list[int]:
        stream = stub.FetchParameters(pb.FetchRequest(shard_proof=self.proof), timeout=max(30.0, self.wait_s),
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
