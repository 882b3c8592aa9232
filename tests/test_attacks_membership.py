"""A stolen island key must not wreck a run: what one valid credential can claim, hold and push.

Each test plays the attacker with a client built from the .proto alone (diloco.v1 stubs over
grpc.secure_channel with a valid island certificate of the run) beside honest clients, and asserts the
refusal or the bound. Before these bounds (measured on the previous release): a Join declaring 4096 ranks
was accepted and its push claiming 4096x an honest island's tokens was folded at 4096x its weight; an
island leaving and rejoining after every round held every round to its deadline (12 of 12); 30 join/leave
cycles with 2 MB hostnames kept every record (+81 MiB RSS, +57 MiB of log, a 57 MB /api/run), and a
newline in a hostname forged a log line.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request

import grpc
import pytest
import torch

from conftest import claim, tiny_config, wait_for_round
from kit import Clock
from coordinator.membership import Membership
from coordinator.web import RunWebServer
from diloco.security import credentials
from diloco.wire.codec import Fp32Codec
from diloco.wire.refusal import Reason, reason_of
from diloco.security.untrusted import HOSTNAME_MAX, bounded
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

MB = 1 << 20




@pytest.fixture
def stub_as(run_ca):
    """A stub over mutual TLS under one of the run's island certificates; every channel is closed after the test."""
    channels = []

    def make(coordinator, name: str) -> pb_grpc.CoordinatorStub:
        ca, cert, key = credentials.island_files(run_ca, name).read()
        channel = grpc.secure_channel(f"127.0.0.1:{coordinator.port}", grpc.ssl_channel_credentials(ca, key, cert),
                                      options=[("grpc.max_send_message_length", 4 * MB)])
        channels.append(channel)
        return pb_grpc.CoordinatorStub(channel)

    yield make
    for channel in channels:
        channel.close()


def _join(stub, ranks: int = 0, **fields) -> pb.JoinResponse:
    return stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, ranks=ranks, **fields), timeout=30)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def _push(stub, coordinator, island_id: str, round_: int, tokens_and_steps: dict) -> pb.PushResponse:
    """A whole contribution of zeros, claiming tokens_and_steps, trained from the round's global parameters."""
    pg = {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}
    header = pb.PushHeader(island_id=island_id, round=round_, codec="fp32", global_checksum=coordinator.state.checksum,
                           **tokens_and_steps)
    return stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=60)


# -- 1. ranks come from the run, not from the island's word -------------------------------------------


@pytest.mark.integration
def test_an_island_declares_at_most_the_ranks_its_certificate_carries(tls_coordinator, stub_as):
    cfg = tiny_config("rounds.rounds=2", "rounds.min_islands=2")
    coordinator = tls_coordinator(cfg)
    east, mallory = stub_as(coordinator, "east"), stub_as(coordinator, "mallory")

    error = _refused(lambda: _join(mallory, ranks=4096))
    assert reason_of(error) == Reason.BAD_REQUEST and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "declared 4096 ranks; its certificate allows 1 to 1" in error.details()
    assert "diloco-certs island DIR mallory --ranks 4096 --force" in error.details()
    assert not coordinator.state.islands

    honest, attacker = _join(east).island_id, _join(mallory, ranks=1).island_id
    # A rejoin (another replica group of the same credential) cannot raise them either.
    assert reason_of(_refused(lambda: _join(mallory, ranks=2))) == Reason.BAD_REQUEST
    assert coordinator.state.islands[attacker].ranks == 1

    # The push claiming 4096x an honest island's tokens: refused on its claim (it was folded at 4096x the weight).
    error = _refused(lambda: _push(mallory, coordinator, attacker, 0, claim(cfg, 1, ranks=4096)))
    assert reason_of(error) == Reason.BAD_REQUEST
    _push(east, coordinator, honest, 0, claim(cfg))
    _push(mallory, coordinator, attacker, 0, claim(cfg))
    wait_for_round(coordinator, 0, timeout_s=120)
    weights = {c.island_id: c.weight for c in coordinator.state.summaries[-1].contributions}
    assert weights[attacker] == weights[honest] == claim(cfg)["tokens"], weights


@pytest.mark.integration
def test_a_certificate_without_ranks_is_refused_at_join_by_default(tls_coordinator, stub_as):
    """Such a certificate was allowed rounds.max_island_ranks (8) ranks: 8x a one-rank island's tokens."""
    coordinator = tls_coordinator(tiny_config())
    legacy = stub_as(coordinator, "legacy")
    for ranks in (0, 1, 8):
        error = _refused(lambda: _join(legacy, ranks=ranks))
        assert reason_of(error) == Reason.BAD_REQUEST and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "diloco-certs island DIR legacy --ranks N --force" in error.details()
        assert "rounds.allow_unranked_certificates" in error.details() and "\n" not in error.details()
    assert not coordinator.state.islands


@pytest.mark.integration
def test_a_multi_rank_island_declares_what_it_was_issued_and_an_old_certificate_the_configs_cap(tls_coordinator, stub_as):
    coordinator = tls_coordinator(tiny_config("rounds.max_island_ranks=4", "rounds.allow_unranked_certificates=true"))
    sharded, legacy = stub_as(coordinator, "sharded"), stub_as(coordinator, "legacy")
    assert coordinator.state.islands[_join(sharded, ranks=2).island_id].ranks == 2  # a 1 x 2 FSDP island
    assert reason_of(_refused(lambda: _join(sharded, ranks=3))) == Reason.BAD_REQUEST
    # A certificate from before certificates carried ranks: rounds.max_island_ranks, whatever it declares.
    error = _refused(lambda: _join(legacy, ranks=5))
    assert reason_of(error) == Reason.BAD_REQUEST
    assert "rounds.max_island_ranks = 4 (its certificate carries no ranks)" in error.details()
    assert coordinator.state.islands[_join(legacy, ranks=4).island_id].ranks == 4


@pytest.mark.integration
def test_without_mutual_tls_the_config_caps_ranks(make_coordinator, channel_to):
    cfg = tiny_config()
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    most = cfg.rounds.max_island_ranks
    assert most == 8  # the default: one machine's accelerators (plaintext serves loopback only)
    error = _refused(lambda: _join(stub, ranks=most + 1))
    assert reason_of(error) == Reason.BAD_REQUEST and "rounds.max_island_ranks = 8 (plaintext" in error.details()
    assert reason_of(_refused(lambda: _join(stub, ranks=-1))) == Reason.BAD_REQUEST
    assert coordinator.state.islands[_join(stub, ranks=most).island_id].ranks == most


# -- 7. leaving and rejoining does not reset the idle count -----------------------------------------------


@pytest.mark.integration
def test_an_island_that_leaves_and_rejoins_after_every_round_holds_no_round(tls_coordinator, stub_as, caplog):
    cfg = tiny_config("rounds.rounds=3", "rounds.min_islands=2", "rounds.deadline_s=60", "rounds.lease_s=600")
    coordinator = tls_coordinator(cfg)
    caplog.set_level(logging.INFO, logger="coordinator")
    east, west, mallory = (stub_as(coordinator, n) for n in ("east", "west", "mallory"))
    honest = [(east, _join(east).island_id), (west, _join(west).island_id)]
    attacker = _join(mallory).island_id

    def cycle() -> str:
        mallory.Leave(pb.LeaveRequest(island_id=attacker), timeout=30)
        return _join(mallory).island_id

    for round_ in range(3):
        assert cycle() == attacker  # one credential, one record: its idle count and probation follow it
        assert coordinator.state.islands[attacker].probation
        for stub, island_id in honest:
            _push(stub, coordinator, island_id, round_, claim(cfg))
        wait_for_round(coordinator, round_, timeout_s=180)  # a deadline each would still pass here: see the reasons
    closed = [m.split(":")[0] for m in caplog.messages if m.startswith("round ") and " closed (" in m]  # less the losses
    assert closed == [f"round {r} closed (every live island contributed) with 2 islands" for r in range(3)], closed
    assert [i.island_id for i in coordinator.state.departed].count(attacker) <= 1


@pytest.mark.unit
def test_a_fresh_credential_holds_one_round_at_most_however_it_leaves_and_rejoins():
    """The membership alone, on a fake clock: a first join is waited for (an honest island's first round is too),
    and no leave, rejoin or lease expiry gets it waited for again until it contributes."""
    clock = Clock(0.0)
    members = Membership(max_islands=8, shards=1, lease_s=10.0, cond=threading.Condition(), clock=clock,
                         idle_rounds=3)
    honest = members.join("h", owner="east").island_id
    attacker = members.join("m", owner="mallory").island_id
    held = 0
    for round_ in range(12):
        opened = clock.now
        with members.cond:
            held += attacker in members.waited_for()
            members.after_round(opened, [honest])
        clock.now += 1.0
        if round_ % 2:  # leave and rejoin
            members.leave(attacker, "", {}, False)
        else:  # fall silent until its lease runs out, then rejoin
            clock.now += 11.0
            members.touch(honest)
            with members.cond:
                members.live()
        assert members.join("m", owner="mallory").island_id == attacker
        members.touch(honest)
    assert held == 1
    with members.cond:  # once it contributes it is waited for like any island
        members.after_round(clock.now, [honest, attacker])
        assert attacker in members.waited_for()


# -- 10. what a client sends is bounded where it is kept and escaped where it is logged ---------------------


@pytest.mark.integration
def test_a_newline_in_what_a_client_sends_cannot_forge_a_log_line(tls_coordinator, stub_as, caplog):
    coordinator = tls_coordinator(tiny_config())
    caplog.set_level(logging.DEBUG, logger="coordinator")
    mallory = stub_as(coordinator, "mallory")
    forged = "INFO coordinator.membership: island-7 left; checksum matches"
    island_id = _join(mallory, hostname=f"evil\n{forged}\r\x1b[2K").island_id
    _refused(lambda: mallory.Heartbeat(pb.HeartbeatRequest(island_id=f"island-9\n{forged}"), timeout=30))
    mallory.Leave(pb.LeaveRequest(island_id=island_id, checksum=f"x\n{forged}", fragment_checksums=[f"y\n{forged}"] * 100),
                  timeout=30)
    lines = [caplog.handler.format(r) for r in caplog.records if r.name.startswith("coordinator")]
    assert not [line for line in lines if any(c in line for c in "\n\r\x1b")], lines  # one line per record
    assert any(f"joined from evil\\n{forged}\\r\\x1b[2K at round 0" in line for line in lines), lines  # escaped
    assert any(f"{island_id} left; checksum DIFFERS" in line for line in lines), lines
    record = coordinator.state.departed[-1]
    assert record.hostname.startswith("evil\\n") and "\n" not in record.final_checksum


def _cycles(coordinator, stub, n: int, hostname_bytes: int) -> None:
    for k in range(n):
        hostname = f"{k}-" + "h" * hostname_bytes
        island_id = _join(stub, hostname=hostname, island_key=hostname).island_id
        stub.Leave(pb.LeaveRequest(island_id=island_id, checksum="c" * MB), timeout=30)


def _api_run(coordinator) -> bytes:
    with RunWebServer(coordinator.state, host="127.0.0.1", port=0) as web:
        with urllib.request.urlopen(f"{web.url}api/run", timeout=60) as response:
            return response.read()


def _log_bytes(caplog) -> int:
    return len(caplog.text.encode())


@pytest.mark.integration
@pytest.mark.parametrize("tls", [True, False], ids=["one-credential", "plaintext-fresh-ids"])
def test_join_leave_cycles_with_megabyte_hostnames_leave_bounded_records(tls, tls_coordinator, stub_as, make_coordinator,
                                                                         channel_to, caplog):
    cfg = tiny_config("wire.chunk_bytes=1048576", "limits.joins_per_minute=600", "limits.departed_kept=8")
    coordinator = tls_coordinator(cfg) if tls else make_coordinator(cfg)
    stub = stub_as(coordinator, "mallory") if tls else channel_to(coordinator)
    caplog.set_level(logging.INFO, logger="coordinator")
    _cycles(coordinator, stub, 30, MB)
    members = coordinator.state.members
    records = [*members.islands.values(), *members.departed, *members.expired.values()]
    # One credential is one record, however often it comes back; fresh plaintext ids: the last departed_kept.
    assert len(records) == (1 if tls else 8) and members.joined == (1 if tls else 30)
    assert all(len(i.hostname) <= HOSTNAME_MAX and len(i.key) <= 128 and len(i.final_checksum) <= 64 for i in records)
    checkpoint = json.dumps(members.state_dict())
    body = _api_run(coordinator)
    assert len(checkpoint) < 16_000 and len(body) < 16_000, (len(checkpoint), len(body))
    assert _log_bytes(caplog) < 30 * 2 * 1000  # two lines a cycle, each with a bounded hostname
    assert json.loads(body)["islands"][-1]["hostname"] == bounded("29-" + "h" * MB, HOSTNAME_MAX)
