"""A stolen island key must not drain the run's data: what one member may lease of a token corpus.

The attacker ("mallory") holds a valid island certificate of the run's CA and talks to the coordinator with the
generated stubs. Before the bound (measured on the previous release): 40 Lease calls of 2^20 samples each from one
member were all granted (41,943,040 positions), and at the end the data account read epoch 36,336 and 2.68e9 tokens
lost. Now a member may hold only what its ranks train in the rounds ahead (coordinator/ledger.py LeaseBound), and
what it never trained goes back when it leaves.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from conftest import claim, tiny_config, wait_for_round
from kit import write_corpus
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def stub_as(run_ca):
    """A stub over mutual TLS under one of the run's island certificates; every channel is closed after the test."""
    channels = []

    def make(coordinator, name: str) -> pb_grpc.CoordinatorStub:
        ca, cert, key = credentials.island_files(run_ca, name).read()
        channel = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert))
        channels.append(channel)
        return pb_grpc.CoordinatorStub(channel)

    yield make
    for channel in channels:
        channel.close()


def _lease(stub, island_id: str, index: int, samples: int) -> list[tuple[int, int]]:
    reply = stub.Lease(pb.LeaseRequest(island_id=island_id, index=index, samples=samples), timeout=30)
    return [(r.start, r.stop) for r in reply.ranges]


def _push(stub, coordinator, island_id: str, round_: int, samples: list[tuple[int, int]], steps: int) -> None:
    """A whole contribution of zeros trained on `samples` in `steps` inner steps, from the round's parameters."""
    cfg = coordinator.state.cfg
    pg = {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}
    header = pb.PushHeader(island_id=island_id, round=round_, codec="fp32", global_checksum=coordinator.state.checksum,
                           samples=[pb.SampleRange(start=a, stop=b) for a, b in samples], **claim(cfg, steps))
    stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=60)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_a_member_holds_only_what_its_ranks_train_in_the_rounds_ahead(corpus, tmp_path, tls_coordinator, stub_as):
    rounds = 3
    cfg = tiny_config("data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0",
                      f"data.cache_dir={str(tmp_path / 'cache')!r}", f"rounds.rounds={rounds}", "rounds.min_islands=3",
                      "rounds.deadline_s=600", "rounds.lease_s=600")
    coordinator = tls_coordinator(cfg)
    h, batch = cfg.inner.steps_per_round, cfg.inner.batch_size
    per_round = h * batch  # one rank's samples of a round: an honest island's lease (islands/feed.py)
    ahead = cfg.limits.lease_rounds
    stubs = {name: stub_as(coordinator, name) for name in ("east", "west", "mallory")}
    ids = {name: stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=30).island_id
           for name, stub in stubs.items()}
    mallory, attacker = stubs["mallory"], ids["mallory"]

    # The issue's attack: leases of 2^20 samples. One lease is at most a round of its ranks' samples.
    error = _refused(lambda: _lease(mallory, attacker, 0, 1 << 20))
    assert reason_of(error) == Reason.BAD_REQUEST and f"1..{per_round} samples" in error.details()
    # Leases of a round's samples each, as fast as it can ask: granted for the rounds ahead, then refused.
    granted, refusals = [], []
    for index in range(40):
        try:
            granted.append(_lease(mallory, attacker, index, per_round))
        except grpc.RpcError as e:
            refusals.append(e)
    assert len(granted) == ahead and len(refusals) == 40 - ahead
    assert {reason_of(e) for e in refusals} == {Reason.RATE_LIMITED}
    assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refusals)
    # A fresh id to lease under is refused: an allowance is a member's.
    assert reason_of(_refused(lambda: _lease(mallory, "island-999", 0, per_round))) == Reason.NOT_A_MEMBER

    # The honest islands lease a round's samples a round and push on them; so does mallory, from what it holds.
    # Every round closes on its contributions (none waits for a deadline), and the honest leases are all granted.
    for round_ in range(rounds):
        for name in ("east", "west"):
            _push(stubs[name], coordinator, ids[name], round_, _lease(stubs[name], ids[name], round_, per_round), h)
        _push(mallory, coordinator, attacker, round_, granted[round_], h)
        wait_for_round(coordinator, round_, timeout_s=120)
        # Each closed round gives one round's samples back to its allowance, not more.
        if round_ < rounds - 1:
            _lease(mallory, attacker, ahead + round_, per_round)
            assert reason_of(_refused(lambda: _lease(mallory, attacker, ahead + round_ + 1, per_round))) == Reason.RATE_LIMITED
    # Each round closed with all three (a deadline would have been 600 s, past the 120 s waited above).
    summaries = [(m.round, len(m.islands)) for m in coordinator.state.summaries if m.fragment == 0]
    assert summaries == [(r, 3) for r in range(rounds)], summaries

    # What mallory never trained goes back when it leaves: nothing is lost, nothing held by it.
    before = coordinator.state.ledger.account(0, []).returned
    mallory.Leave(pb.LeaveRequest(island_id=attacker), timeout=30)
    account = coordinator.state.ledger.account(0, [])
    seq = cfg.data.seq_len
    assert account.returned - before == (ahead + rounds - 1 - rounds) * per_round * seq
    assert account.lost == 0 and account.repeated == 0 and account.epoch == 0
    assert account.folded == 3 * rounds * per_round * seq
    leased_positions = (2 * rounds + ahead + rounds - 1) * per_round
    assert account.leased == leased_positions * seq
    print(f"\nmallory: {len(granted)} of 40 leases of {per_round} samples granted, {len(refusals)} refused RATE_LIMITED; "
          f"a 2^20 lease refused BAD_REQUEST; account: {leased_positions} positions leased, epoch {account.epoch}, "
          f"lost {account.lost} tokens, returned {account.returned} tokens")
