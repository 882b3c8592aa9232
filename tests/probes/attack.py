"""The attacks of issue 15, tried again: impersonation, a poisoned push, a join flood, an idle member,
plaintext on a public address.

Impersonation: a client pushes under another island's id, in plaintext and over
mutual TLS with its own certificate. Poisoned push, with robust aggregation off
and on: two islands on the tiny model push honest pseudo-gradients (scale 1e-3) for five
rounds; then one pushes a finite pseudo-gradient 1,000x that scale, first claiming
1e9 tokens, then (if that is refused) an honest round's tokens. Prints the global
parameters' norm before and after the poisoned round, against the most an honest
round moved it. Join flood: one certificate joins 62 times under fresh ids, then
the real islands join. Idle member: an island joins and never pushes; how long
each round is held. Public address: the coordinator asked to serve 0.0.0.0 with
no certificates.

Run from the repository root:  python -m tests.probes.attack   (about half a minute)
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import grpc
import torch

from coordinator.server import start_coordinator
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import reason_of
from diloco.config import load_config
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

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
            header = pb.PushHeader(island_id=ids[i], round=round_, tokens=tokens, codec="fp32", inner_steps=h, first_step=round_ * h,
                                   global_checksum=c.state.fragments[0].checksum)
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


def _refusal(e: grpc.RpcError) -> str:
    return f"{e.code().name} {pb.Refusal.Reason.Name(reason_of(e))}"


def _tls_run(cfg, names: list[str]):
    """A coordinator over mutual TLS and a stub per certificate name (a CA made for the occasion)."""
    ca_dir = Path(tempfile.mkdtemp(prefix="diloco-attack-ca-"))
    credentials.create_ca(ca_dir)
    credentials.issue_coordinator(ca_dir, ["127.0.0.1"])
    for name in names:
        credentials.issue_island(ca_dir, name)
    c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=tempfile.mkdtemp(prefix="diloco-attack-"),
                          tls=credentials.coordinator_files(ca_dir))
    channels = []
    for name in names:
        ca, cert, key = credentials.island_files(ca_dir, name).read()
        channels.append(grpc.secure_channel(f"127.0.0.1:{c.port}", grpc.ssl_channel_credentials(ca, key, cert)))
    return c, channels, {n: pb_grpc.CoordinatorStub(ch) for n, ch in zip(names, channels)}


def _join(stub, island_id: str = "", key: str = "") -> str:
    return stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_id=island_id, island_key=key), timeout=10).island_id


def impersonation() -> str:
    cfg = load_config(None, TINY)
    chunks = lambda c: list(tensor_chunks({n: torch.zeros(s) for n, s in c.state.manifest.shapes.items()}, Fp32Codec(), 4096))  # noqa: E731
    header = lambda island: pb.PushHeader(island_id=island, round=0, tokens=128, codec="fp32", inner_steps=1,  # noqa: E731
                                          global_checksum=c.state.fragments[0].checksum)
    c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=tempfile.mkdtemp(prefix="diloco-attack-"))
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        victim = _join(stub, key="victim")
        stub.PushPseudoGradient(push_messages(header(victim), chunks(c)), timeout=30)  # anyone may, in plaintext
        plaintext = "accepted"
    finally:
        channel.close()
        c.stop(0.5)
    c, channels, stubs = _tls_run(cfg, ["east", "mallory"])
    try:
        victim = _join(stubs["east"])
        try:
            stubs["mallory"].PushPseudoGradient(push_messages(header(victim), chunks(c)), timeout=30)
            tls = "accepted"
        except grpc.RpcError as e:
            tls = f"refused ({_refusal(e)})"
    finally:
        for ch in channels:
            ch.close()
        c.stop(0.5)
    return f"impersonation: a push under another island's id, plaintext: {plaintext}; mutual TLS: {tls}"


def join_flood() -> str:
    cfg = load_config(None, TINY + ["rounds.max_islands=64"])
    c, channels, stubs = _tls_run(cfg, ["east", "west", "mallory"])
    try:
        outcomes: dict[str, int] = {}
        for i in range(62):
            try:
                outcome = f"joined as {_join(stubs['mallory'], island_id=f'fresh-{i}')}"
            except grpc.RpcError as e:
                outcome = f"refused {_refusal(e)}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        members_after_flood = len(c.state.islands)
        real = [_join(stubs[n]) for n in ("east", "west")]
        counts = ", ".join(f"{n} {o}" for o, n in outcomes.items())
        return (f"join flood: 62 joins under fresh ids from one certificate: {counts}; islands in the run after it: "
                f"{members_after_flood}; the real islands then joined as {real}")
    finally:
        for ch in channels:
            ch.close()
        c.stop(0.5)


def idle_member(rounds: int = 7) -> str:
    # first_quorum 1: the worker pushes alone from round 0 (the subject is the idler, not the run's first step).
    cfg = load_config(None, TINY + [f"rounds.rounds={rounds + 1}", "rounds.min_islands=1", "rounds.deadline_s=2",
                                    "robust.check_claims=false", "robust.first_quorum=1"])
    c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=tempfile.mkdtemp(prefix="diloco-attack-"))
    channel = grpc.insecure_channel(f"127.0.0.1:{c.port}")
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        worker, idler = _join(stub, key="worker"), _join(stub, key="idler")
        zeros = {n: torch.zeros(s) for n, s in c.state.manifest.shapes.items()}
        for r in range(rounds):
            header = pb.PushHeader(island_id=worker, round=r, tokens=128, codec="fp32", inner_steps=1,
                                   global_checksum=c.state.fragments[0].checksum)
            stub.PushPseudoGradient(push_messages(header, tensor_chunks(zeros, Fp32Codec(), 4096)), timeout=30)
            if r == cfg.limits.idle_rounds + 1:  # it was removed: it comes back, on probation
                _join(stub, island_id=idler)
            with c.state.cond:
                assert c.state.cond.wait_for(lambda: c.state.round > r, 60), f"round {r} did not close"
        held = " ".join(f"{s.seconds:.1f}" for s in c.state.summaries[:rounds])
        return (f"idle member (rounds.deadline_s=2, limits.idle_rounds={cfg.limits.idle_rounds}): seconds per round {held}; "
                f"removed idle: {c.state.events.idle_removed}, back on probation at round {cfg.limits.idle_rounds + 1}")
    finally:
        channel.close()
        c.stop(0.5)


def public_plaintext() -> str:
    try:
        c = start_coordinator(load_config(None, TINY), "0.0.0.0", 0, spool_dir=tempfile.mkdtemp(prefix="diloco-attack-"))
        c.stop(0.5)
        return "plaintext on 0.0.0.0: served"
    except ValueError as e:
        return f"plaintext on 0.0.0.0: refused ({str(e).split(':')[0]})"


if __name__ == "__main__":
    print(impersonation())
    for robust in (False, True):
        print(attack(robust))
    print(join_flood())
    print(idle_member())
    print(public_plaintext())
