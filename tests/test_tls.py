"""Mutual TLS between islands and the coordinator: identity bound to the certificate, revocation, no plaintext off loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest
import torch

from conftest import claim, tiny_config
from coordinator.server import start_coordinator
from diloco import credentials
from diloco.codec import Fp32Codec
from diloco.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire import PROTOCOL_VERSION, Manifest, push_messages, tensor_chunks
from islands.client import CoordinatorClient
from islands.island import Island
from islands.world import IslandWorld


@pytest.fixture
def run_ca(tmp_path):
    d = tmp_path / "tls"
    credentials.create_ca(d)
    credentials.issue_coordinator(d, ["127.0.0.1"])
    for name in ("east", "west"):
        credentials.issue_island(d, name)
    return d


@pytest.fixture
def tls_coordinator(run_ca, tmp_path):
    started = []

    def start(cfg, audit_url: str = ""):
        c = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / f"spool{len(started)}"),
                              tls=credentials.coordinator_files(run_ca),
                              revocations=credentials.RevocationList(run_ca / "revoked.json", check_interval_s=0.0),
                              audit_url=audit_url)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop(0.5)


def _stub(run_ca, port: int, name: str) -> tuple[grpc.Channel, pb_grpc.CoordinatorStub]:
    ca, cert, key = credentials.island_files(run_ca, name).read()
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert))
    return channel, pb_grpc.CoordinatorStub(channel)


def _refusal(call) -> int:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return reason_of(e.value)


def test_an_island_trains_over_mutual_tls_and_ends_on_the_coordinators_parameters(run_ca, tls_coordinator):
    cfg = tiny_config("rounds.rounds=2")
    coordinator = tls_coordinator(cfg)
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10, tls=credentials.island_files(run_ca, "east"))
    try:
        result = Island(cfg, world, client, client.join(cfg.digest())).run()
    finally:
        client.close()
        world.shutdown()
    assert result.rounds == 2 and result.checksum_matches
    assert [i.owner for i in coordinator.state.departed] == ["east"]


def test_nobody_acts_as_another_credentials_island(run_ca, tls_coordinator):
    cfg = tiny_config("rounds.rounds=2")
    coordinator = tls_coordinator(cfg)
    east_channel, east = _stub(run_ca, coordinator.port, "east")
    west_channel, west = _stub(run_ca, coordinator.port, "west")
    try:
        joined = east.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
        mine = joined.island_id
        # The same credential joining again (another replica group) is the same island; the other one is not.
        assert east.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).island_id == mine
        assert west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).island_id != mine
        pg = {n: torch.zeros(s) for n, s in Manifest.from_proto(joined.parameters).shapes.items()}
        header = pb.PushHeader(island_id=mine, round=0, codec="fp32", **claim(cfg))
        calls = {
            "join as": lambda: west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_id=mine), timeout=10),
            "heartbeat": lambda: west.Heartbeat(pb.HeartbeatRequest(island_id=mine), timeout=10),
            "push": lambda: west.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=10),
            "pull": lambda: list(west.PullRoundResult(pb.PullRequest(island_id=mine, round=0, timeout_s=1), timeout=10)),
            "fetch": lambda: list(west.FetchParameters(pb.FetchRequest(island_id=mine), timeout=10)),
            "leave": lambda: west.Leave(pb.LeaveRequest(island_id=mine), timeout=10),
        }
        for what, call in calls.items():
            assert _refusal(call) == Reason.NOT_YOURS, what
        assert mine in coordinator.state.islands  # untouched by all of that
        east.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=10)
    finally:
        east_channel.close()
        west_channel.close()


def test_a_revoked_credential_is_removed_from_the_run_and_its_contribution_dropped(run_ca, tls_coordinator, tmp_path):
    cfg = tiny_config("rounds.rounds=2", "rounds.min_islands=2")
    coordinator = tls_coordinator(cfg, audit_url=str(tmp_path / "audit"))
    east_channel, east = _stub(run_ca, coordinator.port, "east")
    try:
        joined = east.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)
        shapes = Manifest.from_proto(joined.parameters).shapes
        half = {n: torch.zeros(s) for n, s in list(shapes.items())[:1]}  # part of a contribution: pending
        header = pb.PushHeader(island_id=joined.island_id, round=0, codec="fp32", **claim(cfg))
        east.PushPseudoGradient(push_messages(header, tensor_chunks(half, Fp32Codec(), 4096)), timeout=10)
        assert joined.island_id in coordinator.state.fragments[0].contributions
        assert credentials.revoke(run_ca, "east", "key leaked")
        assert _refusal(lambda: east.Heartbeat(pb.HeartbeatRequest(island_id=joined.island_id), timeout=10)) == Reason.REVOKED
        assert _refusal(lambda: east.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10)) == Reason.REVOKED
        # The round machine's next look at who is live removes it, with its half contribution.
        deadline = time.monotonic() + 30
        while joined.island_id in coordinator.state.islands and time.monotonic() < deadline:
            with coordinator.state.cond:
                coordinator.state.members.live()
            time.sleep(0.05)
        assert joined.island_id not in coordinator.state.islands
        assert joined.island_id not in coordinator.state.fragments[0].contributions
        assert coordinator.state.events.revoked == 1
    finally:
        east_channel.close()
    # The audit log has it all, in order: the join, the half push, the refusals with their reasons, the removal.
    coordinator.stop(0.5)
    records = [json.loads(line) for part in sorted((tmp_path / "audit").glob("audit-*.jsonl")) for line in part.read_text().splitlines()]
    events = [(r["event"], r.get("reason", ""), r.get("credential", "")) for r in records]
    assert events == [("join", "", "east"), ("push", "", "east"), ("refused", "REVOKED", "east"),
                      ("refused", "REVOKED", "east"), ("revoked", "", "east")], events
    assert records[1]["complete"] is False and records[2]["method"] == "Heartbeat" and records[0]["island"] == joined.island_id


def test_a_client_without_the_runs_certificate_never_reaches_the_coordinator(run_ca, tls_coordinator, tmp_path):
    coordinator = tls_coordinator(tiny_config())
    other = tmp_path / "other"
    credentials.create_ca(other)
    credentials.issue_island(other, "east")
    for files in (None, credentials.island_files(other, "east")):
        if files is None:
            channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
        else:
            ca, cert, key = files.read()
            channel = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert))
        with channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.CoordinatorStub(channel).Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not coordinator.state.islands


def test_plaintext_off_loopback_needs_insecure(tmp_path):
    with pytest.raises(ValueError, match="plaintext: give it the run's certificates"):
        start_coordinator(tiny_config(), "0.0.0.0", 0, spool_dir=str(tmp_path / "spool"))
    for argv, message in [
        (["-m", "islands", "join", "--coordinator", "10.1.2.3:50051"], "is not on this machine: connect with --tls DIR"),
        (["-m", "islands", "join", "--coordinator", "127.0.0.1:1", "--tls", str(tmp_path), "--insecure"], "contradict"),
        (["-m", "coordinator", "serve", "--host", "0.0.0.0", "--port", "0"], "in plaintext: give it the run's certificates"),
    ]:
        out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], (argv, out.stderr[-500:])
