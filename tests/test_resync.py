"""An island whose push is refused while its round is still open trains that round again.

The chaos run on tokens met it: a coordinator restarted from a checkpoint did not
know the leases the islands had trained round 4 on, refused every push of it
(NOT_LEASED), and each island, already at the round's end, pushed an empty
contribution: round 4 closed on no tokens at all. Here the island's round-1 push
carries a wrong checksum (CHECKSUM_MISMATCH, refused the same way while the round
waits for it): it resyncs, trains round 1's H steps again and contributes them.
"""

from __future__ import annotations

import grpc
import pytest

from conftest import tiny_config
from kit import Puppet, islands_on_threads, wait_for
from diloco.v1 import diloco_pb2 as pb
from islands.client import CoordinatorClient
from islands.state import ReplicaSpec

pytestmark = pytest.mark.integration


def test_a_push_refused_while_its_round_is_open_is_trained_again(make_coordinator, monkeypatch):
    cfg = tiny_config("rounds.rounds=3", "rounds.deadline_s=120", "rounds.lease_s=600")
    coordinator = make_coordinator(cfg)
    state = coordinator.state
    refused = []
    real = CoordinatorClient.push
    puppet = Puppet(coordinator.port, cfg)
    monkeypatch.setattr(CoordinatorClient, "push", _corrupting(real, refused, spare=puppet.island_id))
    try:
        with islands_on_threads(coordinator, cfg, [ReplicaSpec()]) as ((island,), results):
            for round_ in range(3):  # the puppet is in every round; each waits for the island too
                wait_for(state, f"round {round_} to open", lambda: state.round >= round_)
                puppet.push(round_)
    finally:
        puppet.close()
    h, per_step = cfg.inner.steps_per_round, cfg.inner.batch_size * cfg.data.seq_len
    assert refused == [h], "the island's round-1 push was not refused once"
    tokens = {s.round: {c.island_id: c.tokens for c in s.contributions} for s in state.summaries}
    assert [tokens[r][island.island_id] for r in range(3)] == [h * per_step] * 3, tokens
    (result,) = results.values()
    assert result.checksum_matches and result.checksum == state.checksum


def _corrupting(real, refused: list, spare: str = ""):
    """CoordinatorClient.push with the island's first round-1 push claiming a wrong global checksum (spare's pushes,
    the puppet's, go through untouched)."""
    def push(self, header: pb.PushHeader, chunks):
        if header.round == 1 and header.global_checksum and header.island_id != spare and not refused:
            refused.append(header.inner_steps)
            bad = pb.PushHeader()
            bad.CopyFrom(header)
            bad.global_checksum = "0" * 32
            header = bad
        return real(self, header, chunks)
    return push


class _Cancelled(grpc.RpcError):
    """What a call in flight gets when the coordinator stops (a restart): CANCELLED, no refusal."""

    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "CANCELLED"

    def trailing_metadata(self):
        return ()


def test_a_call_cancelled_by_a_stopping_coordinator_is_retried_but_not_after_close(make_coordinator):
    """The 2 x 2 parity scenario met it: the pushing group's pull, cancelled as the coordinator stopped for its
    restart, ended the group (exit 2) while the other group waited for ever. Now it is retried like an unreachable
    coordinator; a call cancelled because we closed our own client is not."""
    coordinator = make_coordinator(tiny_config())
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10, reconnect_s=30)
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 1:
            raise _Cancelled()
        return "pulled"

    try:
        assert client._retry("pull", call) == "pulled" and len(calls) == 2
    finally:
        client.close()
    calls.clear()
    with pytest.raises(grpc.RpcError):
        client._retry("pull", call)
    assert len(calls) == 1
