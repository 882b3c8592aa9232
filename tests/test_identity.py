"""Islands are named as their certificates are, and one identity is one live process (issue 43).

Under mutual TLS an island's id is the name its certificate was issued for (`diloco-certs init --islands
east,west`): the coordinator's log, the report, the round log and the dashboard name it so, and so does the island's
own log. A second process that joins as an island another live process is (the same certificate; the same id in
plaintext) replaces it: the old one's calls are refused REPLACED and it stops with one line and exit status 3, the
coordinator says so in one line, and the new one trains. Before: "island-0 rejoined from vm at round 0", and both
trained as one island, neither side saying so.
"""

from __future__ import annotations

import logging
import sys
import threading

import grpc
import pytest
import torch

from conftest import claim, one_island_config, tiny_config, trained_from
from kit import Clock, StderrLines
from coordinator.membership import Membership
from coordinator.snapshot import run_snapshot
from diloco.security import credentials
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.codec import Fp32Codec
from diloco.wire.messages import INSTANCE_KEY, PROTOCOL_VERSION, tensor_chunks
from diloco.wire.refusal import Reason, Refused, reason_of
from islands.outcome import REPLACED_EXIT

ISLAND = [sys.executable, "-m", "islands"]
BOUND_S = 240.0  # generous: an island process starts (torch's imports) and runs a few tiny rounds on 2 busy cores


def _island(address: str, run_ca, name: str, *flags: str) -> StderrLines:
    return StderrLines(ISLAND + ["join", "--coordinator", address, "--device", "cpu", "--threads", "1",
                                 "--tls", str(run_ca), "--tls-name", name, *flags])


def _replacements(caplog) -> list[str]:
    return [m for m in caplog.messages if "a new process joined" in m]


@pytest.mark.integration
def test_islands_are_named_as_their_certificates_in_every_log_report_and_dashboard(run_ca, tls_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="coordinator")
    coordinator = tls_coordinator(tiny_config("rounds.rounds=2"))
    address = f"127.0.0.1:{coordinator.port}"
    islands = {name: _island(address, run_ca, name) for name in ("east", "west")}
    try:
        codes = {name: island.exit_code(BOUND_S) for name, island in islands.items()}
        texts = {name: island.text() for name, island in islands.items()}
    finally:
        for island in islands.values():
            island.close()
    assert codes == {"east": 0, "west": 0}, texts
    for name, text in texts.items():  # the island's own lines
        assert f"joined {address} as {name} at round 0" in text, text
        assert f"{name} finished at round 2 after 2 rounds" in text, text
    # The coordinator's log.
    for name in ("east", "west"):
        assert any(m.startswith(f"{name} joined from ") for m in caplog.messages), caplog.messages
        assert f"{name} left; checksum matches" in caplog.messages, caplog.messages
    assert not any("island-" in m for m in caplog.messages), [m for m in caplog.messages if "island-" in m]
    # The report and its rounds (what the round log writes), and the dashboard's islands.
    report = coordinator.report()
    assert set(report["islands"]) == {"east", "west"}, report["islands"]
    assert [sorted(r["islands"]) for r in report["rounds"]] == [["east", "west"]] * 2  # in the order they joined
    assert [i["island_id"] for i in run_snapshot(coordinator.state)["islands"]] == ["east", "west"]
    assert sorted(i.owner for i in coordinator.state.departed) == ["east", "west"]


@pytest.mark.integration
def test_a_second_process_with_the_same_certificate_replaces_the_first_which_stops_in_one_line(
        run_ca, tls_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="coordinator")
    # A run that outlasts the test: the first process never finishes it; the second leaves after 2 rounds.
    coordinator = tls_coordinator(one_island_config("rounds.rounds=100000"))
    address = f"127.0.0.1:{coordinator.port}"
    first = _island(address, run_ca, "west", "--throttle", "0.05")
    second = None
    try:
        first.wait_for(f"joined {address} as west at round ", BOUND_S)
        first.wait_for("west step ", BOUND_S)  # it trains: a live process, rounds closing
        second = _island(address, run_ca, "west", "--max-rounds", "2")
        joined = second.wait_for(f"joined {address} as west (replacing a live process from ", BOUND_S)
        assert joined.split("(replacing a live process from ", 1)[1].split(") at round ")[0], joined
        # The first stops, with one line that says what happened, and its own exit status.
        assert first.exit_code(BOUND_S) == REPLACED_EXIT, first.text()[-3000:]
        said = [line for line in first.lines if line is not None and "another process" in line]
        assert len(said) == 1 and said[0] == [line for line in first.lines if line is not None][-1], first.text()[-3000:]
        assert said[0].startswith("diloco-island: error: another process joined as west from "), said
        assert said[0].endswith("; this one stops") and " UTC; " in said[0], said
        assert "REPLACED" not in first.text() and "Traceback" not in first.text(), first.text()[-3000:]
        # The second trains, and leaves on the coordinator's parameters.
        assert second.exit_code(BOUND_S) == 0, second.text()[-3000:]
        assert "west finished at round " in second.text() and "(matches the coordinator's)" in second.text(), second.text()
    finally:
        first.close()
        if second is not None:
            second.close()
    # The coordinator's one line, naming both processes.
    (line,) = _replacements(caplog)
    assert line.startswith("west: a new process joined (from ") and line.endswith(") is replaced"), line
    assert coordinator.state.events.islands_replaced == 1
    assert [i.island_id for i in coordinator.state.departed] == ["west"]  # the second left it, after its 2 rounds


def _stub(run_ca, port: int, name: str) -> tuple[grpc.Channel, pb_grpc.CoordinatorStub]:
    ca, cert, key = credentials.island_files(run_ca, name).read()
    channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca, key, cert))
    return channel, pb_grpc.CoordinatorStub(channel)


def _as(process: str) -> tuple[tuple[str, str], ...]:
    return ((INSTANCE_KEY, process),)


@pytest.mark.integration
def test_a_push_that_ends_after_its_process_was_replaced_is_refused_and_nothing_of_it_is_kept(
        run_ca, tls_coordinator, caplog):
    caplog.set_level(logging.INFO, logger="coordinator")
    cfg = tiny_config()  # robust.first_quorum 2: round 0 stays open with west's push alone
    coordinator = tls_coordinator(cfg)
    channel, west = _stub(run_ca, coordinator.port, "west")
    try:
        joined = west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname="vm-a"), timeout=30,
                           metadata=_as("a" * 32))
        assert joined.island_id == "west" and joined.replaced == ""
        shapes = coordinator.state.manifest.shapes
        chunks = list(tensor_chunks({n: torch.full(s, 1e-3) for n, s in shapes.items()}, Fp32Codec(), cfg.wire.chunk_bytes))
        header = pb.PushHeader(island_id="west", round=0, codec="fp32", global_checksum=trained_from(coordinator), **claim(cfg))
        release = threading.Event()

        def stream():
            yield pb.PushMessage(header=header)
            yield from (pb.PushMessage(chunk=c) for c in chunks)
            assert release.wait(BOUND_S)
            yield pb.PushMessage(end=pb.PushEnd(chunks=len(chunks)))

        push = west.PushPseudoGradient.future(stream(), timeout=BOUND_S, metadata=_as("a" * 32))
        # Another process joins as west while the first one's push is in flight.
        again = west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname="vm-b"), timeout=30,
                          metadata=_as("b" * 32))
        assert again.island_id == "west" and again.replaced.startswith("vm-a (ipv4:127.0.0.1:"), again.replaced
        release.set()
        with pytest.raises(grpc.RpcError) as refused:
            push.result(timeout=BOUND_S)
        assert reason_of(refused.value) == Reason.REPLACED, refused.value
        assert refused.value.details().startswith("another process joined as west from vm-b (ipv4:127.0.0.1:")
        assert "west" not in coordinator.state.fragments[0].contributions  # nothing of the old process's push
        # The old process's every call is refused, its join too; the new one is the island.
        for call in (lambda: west.Heartbeat(pb.HeartbeatRequest(island_id="west"), timeout=30, metadata=_as("a" * 32)),
                     lambda: west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=30, metadata=_as("a" * 32))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert reason_of(e.value) == Reason.REPLACED and e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        west.Heartbeat(pb.HeartbeatRequest(island_id="west"), timeout=30, metadata=_as("b" * 32))
        # The new process rejoining (after a lost lease, another replica group) replaces nobody.
        assert west.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=30, metadata=_as("b" * 32)).replaced == ""
    finally:
        channel.close()
    (line,) = _replacements(caplog)
    assert line.startswith("west: a new process joined (from vm-b (ipv4:127.0.0.1:") and " the one from vm-a (ipv4:" in line


@pytest.mark.unit
def test_who_replaces_whom_and_a_process_resumed_after_its_lease_ran_out():
    clock = Clock()
    members = Membership(8, 4, 10.0, threading.Condition(), clock)
    dropped: list[str] = []
    members.on_replace = dropped.append
    assert members.join("vm-a", owner="west", instance="A", peer="p1").island_id == "west"
    assert members.join("vm-e", owner="east").island_id == "east"
    assert members.join("h", island_id="island-7").island_id == "island-2"  # no credential: named by admission
    # The canonical order (folds, leases) is the admission order, names or not: whoever joins first is first.
    assert members.order({"island-2", "east", "west", "unknown"}) == ["west", "east", "island-2", "unknown"]
    # The same process again (another replica group, a rejoin) replaces nobody.
    told: list[str] = []
    members.join("vm-a", owner="west", instance="A", peer="p1", replaced=told)
    assert told == [] and dropped == []
    # Another process, live: the old one is out, what it half-pushed goes, its calls are refused.
    members.join("vm-b", owner="west", instance="B", peer="p2", replaced=told)
    assert told == ["vm-a (p1)"] and dropped == ["west"] and members.events.islands_replaced == 1
    with pytest.raises(Refused) as e:
        members.check_instance("west", "A")
    assert e.value.reason == Reason.REPLACED and str(e.value).startswith("another process joined as west from vm-b (p2) at ")
    with pytest.raises(Refused):
        members.join("vm-a", owner="west", instance="A")  # it cannot come back and replace the new one
    members.check_instance("west", "B")
    members.check_instance("west", "")  # a call naming no process (a client of its own) is not checked
    # A process killed and resumed after its lease ran out comes back as before, the one before it retired quietly.
    clock.now += 11.0
    assert members.live() == []
    members.join("vm-c", island_id="west", owner="west", instance="C", peer="p3", replaced=told)
    assert told == ["vm-a (p1)"] and members.events.islands_replaced == 1 and members.events.island_restarts == 1
    with pytest.raises(Refused):
        members.check_instance("west", "B")
    # Through a coordinator checkpoint.
    again = Membership(8, 4, 10.0, threading.Condition(), clock)
    again.load_state_dict(members.state_dict())
    again.check_instance("west", "C")
    assert again.order(["island-2", "east", "west"]) == ["west", "east", "island-2"]
    with pytest.raises(Refused):
        again.check_instance("west", "A")
    # A process that joined after that checkpoint (the coordinator restarted from it) is the island: its calls are
    # taken and the one the checkpoint named is out (before: the newer process was refused REPLACED and stopped, in a
    # chaos run whose island was killed and resumed just before the coordinator was).
    again.check_instance("west", "D")
    with pytest.raises(Refused):
        again.check_instance("west", "C")
