"""Mutual TLS between islands and the coordinator: identity bound to the certificate, revocation, no plaintext off loopback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch

from conftest import claim, one_island_config, tiny_config, trained_from
from coordinator.server import start_coordinator
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, Manifest, push_messages, tensor_chunks
from islands.client import CoordinatorClient, CoordinatorUnreachable
from islands.handshake import CoordinatorTlsRefused
from islands.island import Island
from islands.world import IslandWorld

pytestmark = pytest.mark.integration




def _stub(run_ca, port: int, name: str) -> tuple[grpc.Channel, pb_grpc.CoordinatorStub]:
    ca, cert, key = credentials.island_files(run_ca, name).read()
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert))
    return channel, pb_grpc.CoordinatorStub(channel)


def _refusal(call) -> int:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return reason_of(e.value)


def test_an_island_trains_over_mutual_tls_and_ends_on_the_coordinators_parameters(run_ca, tls_coordinator):
    cfg = one_island_config("rounds.rounds=2")  # one island
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
        header = pb.PushHeader(island_id=mine, round=0, codec="fp32", **claim(cfg), global_checksum=trained_from(coordinator))
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
        header = pb.PushHeader(island_id=joined.island_id, round=0, codec="fp32", **claim(cfg),
                               global_checksum=trained_from(coordinator))
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


def _other_run(tmp_path, name: str = "other"):
    """Another run's credentials folder: its own CA and an island 'east'."""
    other = tmp_path / name
    credentials.create_ca(other)
    credentials.issue_island(other, "east")
    return other


def _mixed(run_ca, other, tmp_path):
    """A folder with the other run's island certificate whose ca.pem trusts both runs' CAs (the other's first, the
    one that issued the certificate): the island trusts the coordinator, the coordinator does not trust the island."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "ca.pem").write_bytes((other / "ca.pem").read_bytes() + (run_ca / "ca.pem").read_bytes())
    for suffix in (".pem", ".key"):
        (mixed / f"island-east{suffix}").write_bytes((other / f"island-east{suffix}").read_bytes())
    return mixed


def _refused(address: str, files: credentials.TlsFiles, connect_timeout_s: float = 120.0) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(CoordinatorTlsRefused) as e:
        CoordinatorClient(address, connect_timeout_s=connect_timeout_s, tls=files)
    return str(e.value), time.monotonic() - started


def test_a_certificate_refused_in_the_handshake_ends_the_wait_at_once_and_says_which(
        run_ca, tls_coordinator, make_coordinator, tmp_path):
    # gRPC's channel alone retried such a handshake for the whole connect timeout and then only timed out.
    coordinator = tls_coordinator(tiny_config())
    address = f"127.0.0.1:{coordinator.port}"
    other = _other_run(tmp_path)

    # The island holds another run's CA: the coordinator's certificate is not signed by it.
    message, took = _refused(address, credentials.island_files(other, "east"))
    assert took < 30, took
    assert f"the coordinator's certificate at {address} is not signed by the run's CA in {other / 'ca.pem'}" in message
    assert "unable to get local issuer certificate" in message and "\n" not in message

    # The island trusts the coordinator's CA too, but its own certificate is another run's: the coordinator refuses it.
    mixed = _mixed(run_ca, other, tmp_path)
    message, took = _refused(address, credentials.island_files(mixed, "east"))
    assert took < 30, took
    assert f"the coordinator at {address} refused this island's certificate {mixed / 'island-east.pem'}" in message

    # The coordinator's certificate names 127.0.0.1 only.
    message, took = _refused(f"localhost:{coordinator.port}", credentials.island_files(run_ca, "east"))
    assert took < 30 and "does not name localhost" in message, (took, message)

    # A plaintext coordinator.
    plain = make_coordinator(tiny_config())
    message, took = _refused(f"127.0.0.1:{plain.port}", credentials.island_files(run_ca, "east"))
    assert took < 30 and "does not speak TLS" in message, (took, message)
    assert not coordinator.state.islands and not plain.state.islands


def test_a_coordinator_not_listening_yet_is_waited_for_over_tls(run_ca):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(CoordinatorUnreachable) as e:
        CoordinatorClient(f"127.0.0.1:{port}", connect_timeout_s=2, tls=credentials.island_files(run_ca, "east"))
    assert not isinstance(e.value, CoordinatorTlsRefused)
    assert time.monotonic() - started >= 2
    assert f"cannot reach the coordinator at 127.0.0.1:{port} within 2s over mutual TLS (last: Connection refused)" in str(e.value)


@pytest.mark.parametrize("whose", ["the coordinator's", "the island's"])
def test_diloco_island_with_another_runs_credentials_exits_at_once_with_one_line(run_ca, tls_coordinator, tmp_path, whose):
    coordinator = tls_coordinator(tiny_config())
    address = f"127.0.0.1:{coordinator.port}"
    other = _other_run(tmp_path)
    if whose == "the coordinator's":  # another run's folder: the island does not trust the coordinator's certificate
        folder, expected = other, f"the coordinator's certificate at {address} is not signed by the run's CA in {other / 'ca.pem'}"
    else:  # trusts the coordinator, but holds another run's island certificate, which the coordinator does not trust
        folder = _mixed(run_ca, other, tmp_path)
        expected = f"the coordinator at {address} refused this island's certificate {folder / 'island-east.pem'}"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "islands", "join", "--coordinator", address, "--tls", str(folder), "--device", "cpu",
         "--connect-timeout", "300"],
        capture_output=True, text=True, timeout=240,
    )
    took = time.monotonic() - started
    lines = out.stderr.strip().splitlines()
    # What it connects to, then one error line (no gRPC C-core handshake log), long before the connect timeout:
    # starting the process is most of it.
    assert out.returncode == 2 and len(lines) == 2, out.stderr[-2000:]
    assert lines[0].endswith(f"connecting to {address} (mutual TLS)"), lines[0]
    assert lines[1].startswith(f"diloco-island: error: {expected}"), lines[1]
    assert took < 60, took


def test_an_island_dialing_the_dashboard_port_is_told_it_is_not_the_coordinators_grpc_port(run_ca, tmp_path):
    # It was told the coordinator "serves plaintext; start it with --tls DIR", of a coordinator serving --tls.
    from coordinator.server import Observe
    from islands.handshake import NotACoordinator

    coordinator = start_coordinator(tiny_config(), "127.0.0.1", 0, spool_dir=str(tmp_path / "spool"),
                                    tls=credentials.coordinator_files(run_ca), observe=Observe(http_port=0))
    try:
        dashboard = f"127.0.0.1:{coordinator.web.port}"
        for tls in (credentials.island_files(run_ca, "east"), None):
            started = time.monotonic()
            with pytest.raises(NotACoordinator) as e:
                CoordinatorClient(dashboard, connect_timeout_s=120, tls=tls)
            message = str(e.value)
            assert time.monotonic() - started < 30
            assert message.startswith(f"{dashboard} speaks HTTP/1, a web page, not a diloco coordinator's gRPC"), message
            assert "dashboard" in message and "plaintext" not in message and "\n" not in message
        assert not coordinator.state.islands
    finally:
        coordinator.stop(0.5)


def test_a_plaintext_client_at_a_tls_coordinator_ends_the_wait_at_once_saying_join_with_tls(tls_coordinator):
    # gRPC's plaintext channel retried it silently for the whole connect timeout, then only timed out.
    coordinator = tls_coordinator(tiny_config())
    address = f"127.0.0.1:{coordinator.port}"
    started = time.monotonic()
    with pytest.raises(CoordinatorTlsRefused) as e:
        CoordinatorClient(address, connect_timeout_s=120)
    assert time.monotonic() - started < 30
    assert str(e.value).startswith(f"the coordinator at {address} serves mutual TLS and this island joins in plaintext: "
                                   "join with --tls DIR"), str(e.value)
    assert not coordinator.state.islands
