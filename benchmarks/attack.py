"""The poisoned-push attack of issue 15, with robust aggregation off and on.

Two islands on the tiny model push honest pseudo-gradients (scale 1e-3) for five
rounds; then one pushes a finite pseudo-gradient 1,000x that scale, first claiming
1e9 tokens, then (if that is refused) an honest round's tokens. Prints the global
parameters' norm before and after the poisoned round, against the most an honest
round moved it.

Run from the repository root:  python benchmarks/attack.py   (a few seconds)
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.server import start_coordinator  # noqa: E402
from diloco.codec import Fp32Codec  # noqa: E402
from diloco.config import load_config  # noqa: E402
from diloco.v1 import diloco_pb2 as pb  # noqa: E402
from diloco.v1 import diloco_pb2_grpc as pb_grpc  # noqa: E402
from diloco.wire import PROTOCOL_VERSION, push_messages, tensor_chunks  # noqa: E402

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32",
        "data.seq_len=32", "inner.batch_size=4", "inner.steps_per_round=2", "eval.batches=0", "wire.chunk_bytes=4096",
        "rounds.rounds=8", "rounds.min_islands=2"]


def attack(robust: bool) -> str:
    cfg = load_config(None, TINY + [f"robust.enabled={str(robust).lower()}"])
    c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=tempfile.mkdtemp(prefix="diloco-attack-"))
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        ids = [stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_key=k), timeout=10).island_id for k in "ab"]
        shapes, h = c.state.manifest.shapes, cfg.inner.steps_per_round
        honest_tokens = h * cfg.inner.batch_size * cfg.data.seq_len

        def norm() -> float:
            return math.sqrt(sum(float((t.double() ** 2).sum()) for t in c.state.params.values()))

        def pg(seed: int, scale: float = 1e-3) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(seed)
            return {n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}

        def push(i: int, round_: int, p: dict, tokens: int) -> None:
            header = pb.PushHeader(island_id=ids[i], round=round_, tokens=tokens, codec="fp32", inner_steps=h, first_step=round_ * h)
            stub.PushPseudoGradient(push_messages(header, tensor_chunks(p, Fp32Codec(), cfg.wire.chunk_bytes)), timeout=30)

        def closed(round_: int) -> None:
            with c.state.cond:
                assert c.state.cond.wait_for(lambda: c.state.round > round_, 60), f"round {round_} did not close"

        honest = []
        for r in range(5):
            before = norm()
            push(0, r, pg(10 * r), honest_tokens)
            push(1, r, pg(10 * r + 1), honest_tokens)
            closed(r)
            honest.append(abs(norm() - before))
        before = norm()
        try:
            push(1, 5, pg(99, 1.0), 10**9)
            claim = "accepted"
        except grpc.RpcError as e:
            claim = f"refused ({e.code().name})"
            push(1, 5, pg(99, 1.0), honest_tokens)
        push(0, 5, pg(50), honest_tokens)
        closed(5)
        clipped = list(c.state.summaries[-1].clipped)
        return (f"robust.enabled={robust}: the 1e9-token claim {claim}; global norm {before:.4f} -> {norm():.4f} in the "
                f"poisoned round (honest rounds moved it by at most {max(honest):.4f}); clipped: {clipped or 'none'}")
    finally:
        channel.close()
        c.stop(0.5)


if __name__ == "__main__":
    for robust in (False, True):
        print(attack(robust))
