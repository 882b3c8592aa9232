"""The emulated WAN link (islands.sim.wan): rate, delay, gRPC through it, diloco-sim --wan, bad specs."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import join, tiny_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco.v1 import diloco_pb2_grpc as pb_grpc
from islands.sim import cli as sim_cli
from islands.sim.simulation import run_sim
from islands.sim.wan import WanLink, WanSpecError, parse_link, parse_wan


@pytest.fixture
def links():
    """Starts WanLinks and stops every one of them after the test."""
    started = []

    def make(target, spec):
        link = WanLink(target, spec).start()
        started.append(link)
        return link

    yield make
    for link in started:
        link.stop()


@pytest.fixture
def server():
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(10)
    yield srv
    srv.close()


def _connect(link, srv):
    client = socket.create_connection(("127.0.0.1", link.port), timeout=30)
    peer, _ = srv.accept()
    peer.settimeout(30)
    return client, peer


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, bits, delay",
    [("100mbit:80ms", 100e6, 0.08), ("1gbit:50ms", 1e9, 0.05), ("10mbit:0ms", 10e6, 0.0),
     ("500kbit:120ms", 500e3, 0.12), ("2.5Gbit:0.5s", 2.5e9, 0.5), ("64kbit:250us", 64e3, 250e-6)],
)
def test_parse_link(text, bits, delay):
    spec = parse_link(text)
    assert spec.bits_per_s == pytest.approx(bits) and spec.delay_s == pytest.approx(delay)
    assert str(spec) == text


@pytest.mark.unit
@pytest.mark.parametrize(
    "text, message",
    [("nonsense", "no ':' between rate and delay"), ("100:80ms", "bad rate '100'"),
     ("100mbps:80ms", "unknown rate unit 'mbps'"), ("100mbit:80", "bad delay '80'"),
     ("100mbit:-1ms", "bad delay"), ("0mbit:1ms", "outside 1kbit..100gbit"), ("1gbit:20min", "bad delay")],
)
def test_bad_link_spec_says_what_is_wrong_and_what_is_expected(text, message):
    with pytest.raises(WanSpecError) as e:
        parse_link(text)
    assert message in str(e.value) and "expected RATE:DELAY such as 100mbit:80ms" in str(e.value)


@pytest.mark.unit
def test_parse_wan_gives_one_link_per_island():
    assert [s.bits_per_s for s in parse_wan("10mbit:5ms", 3)] == [10e6] * 3
    assert [s.delay_s for s in parse_wan("1gbit:20ms, 100mbit:80ms", 2)] == [0.02, 0.08]
    with pytest.raises(WanSpecError, match="3 link specs for 2 islands"):
        parse_wan("1gbit:1ms,1gbit:1ms,1gbit:1ms", 2)


def _receive(sock, out):
    """Counts bytes until EOF; the rate is measured from the first arrival to the last."""
    buf = bytearray(1 << 20)
    n = first_n = 0
    first = last = None
    while k := sock.recv_into(buf):
        last = time.monotonic()
        if first is None:
            first, first_n = last, k
        n += k
    out.append((n, (n - first_n) * 8 / (last - first)))


def _send(sock, total):
    payload = memoryview(bytes(1 << 20))
    while total > 0:
        sock.sendall(payload[: min(total, len(payload))])
        total -= len(payload)
    sock.shutdown(socket.SHUT_WR)


# With a delay, the rate shows the delay line is pipelined: 100mbit:50ms keeps 625 KB in flight.
@pytest.mark.integration
@pytest.mark.parametrize("spec", ["10mbit:20ms", "100mbit:50ms", "1gbit:20ms"])
def test_link_delivers_the_configured_rate_in_both_directions_at_once(links, server, spec):
    link = links(server.getsockname(), spec)
    total = int(link.spec.bytes_per_s * 2.0)  # two seconds of data each way
    client, peer = _connect(link, server)
    up, down = [], []
    threads = [threading.Thread(target=_send, args=(client, total)), threading.Thread(target=_receive, args=(peer, up)),
               threading.Thread(target=_send, args=(peer, total)), threading.Thread(target=_receive, args=(client, down))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    client.close()
    peer.close()
    assert up and down, "a transfer did not finish"
    for name, (n, bits_per_s) in (("up", up[0]), ("down", down[0])):
        print(f"{spec} {name}: {bits_per_s / 1e6:.2f} Mbit/s")
        assert n == total
        assert bits_per_s == pytest.approx(link.spec.bits_per_s, rel=0.10), f"{name}: {bits_per_s / 1e6:.1f} Mbit/s"
    assert (link.bytes_up, link.bytes_down) == (total, total)


@pytest.mark.integration
def test_round_trip_takes_twice_the_one_way_delay_and_connecting_one_more(links, server):
    link = links(server.getsockname(), "100mbit:40ms")
    t0 = time.monotonic()
    client, peer = _connect(link, server)
    rtts = []
    for i in range(6):
        start = time.monotonic() if i else t0
        client.sendall(b"p" * 100)
        data = b""
        while len(data) < 100:
            data += peer.recv(100 - len(data))
        peer.sendall(data)
        got = b""
        while len(got) < 100:
            got += client.recv(100 - len(got))
        rtts.append(time.monotonic() - start)
    client.close()
    peer.close()
    print("round trips (ms):", [round(r * 1e3, 1) for r in rtts])
    # TCP's handshake: the first request arrives 3 one-way delays after connecting, its answer 4.
    # Lower bounds are exact; upper bounds leave room for scheduling on a busy machine.
    assert 0.160 <= rtts[0] < 0.160 + 0.040
    assert min(rtts[1:]) >= 0.080
    assert statistics.median(rtts[1:]) < 0.080 + 0.020


@pytest.mark.integration
def test_grpc_through_the_link(links, make_coordinator):
    coordinator = make_coordinator(tiny_config())
    link = links(("127.0.0.1", coordinator.port), "10mbit:25ms")
    with grpc.insecure_channel(link.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="diloco.v1.Coordinator")
        assert health.Check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        rtts = []
        for _ in range(5):
            start = time.monotonic()
            health.Check(request, timeout=10)
            rtts.append(time.monotonic() - start)
        assert join(pb_grpc.CoordinatorStub(channel)).island_id
    # 25 ms each way. Every call takes at least that; the fastest of five is well under a delay applied twice
    # (100 ms): one call alone read 90 ms on a busy machine.
    assert 0.050 <= min(rtts) < 0.050 + 0.040, rtts
    assert link.bytes_up > 0 and link.bytes_down > 0 and link.connections == 1


@pytest.mark.integration
def test_sim_runs_each_island_over_its_own_link(tmp_path):
    cfg = tiny_config("rounds.rounds=1", "rounds.min_islands=2", "data.shards=2")
    wan = parse_wan("100mbit:10ms,10mbit:30ms", 2)
    result = run_sim(cfg, islands=2, workdir=tmp_path, timeout_s=120, echo=lambda s: None, wan=wan)
    report = result.report
    assert [len(r["islands"]) for r in report["rounds"]] == [2]
    assert set(report["islands"].values()) == {report["checksum"]}
    # Every island's traffic went through a link of its own; the links also carried joins and gRPC framing.
    assert len(result.wan_bytes) == 2 and all(up > 0 and down > 0 for up, down in result.wan_bytes)
    assert sum(up for up, _ in result.wan_bytes) >= sum(r["bytes_up"] for r in report["rounds"])
    assert sum(down for _, down in result.wan_bytes) >= sum(r["bytes_down"] for r in report["rounds"])


@pytest.mark.integration
def test_sim_cli_passes_the_links_on_and_names_them_first(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run_sim(*args, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stopped by the test")

    # Where main takes it from once the arguments are checked (islands/sim/cli.py imports the simulation late).
    monkeypatch.setattr("islands.sim.simulation.run_sim", fake_run_sim)
    with pytest.raises(SystemExit):
        sim_cli.main(["--islands", "2", "--wan", "1gbit:20ms", "--workdir", str(tmp_path)])
    assert "each island on its own emulated WAN link 1gbit:20ms" in capsys.readouterr().out.splitlines()[0]
    assert [s.bits_per_s for s in seen["wan"]] == [1e9, 1e9]
    with pytest.raises(SystemExit) as e:
        sim_cli.main(["--islands", "3", "--wan", "1gbit:20ms,10mbit:80ms", "--workdir", str(tmp_path)])
    assert e.value.code == 2
    assert "--wan: 2 link specs for 3 islands" in capsys.readouterr().err


@pytest.mark.integration
def test_sim_with_a_bad_wan_spec_exits_2_with_one_line():
    out = subprocess.run([sys.executable, "-m", "islands.sim", "--wan", "nonsense"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "diloco-sim: error: --wan: bad link 'nonsense': no ':' between rate and delay; expected RATE:DELAY such as "
        "100mbit:80ms (RATE in kbit, mbit or gbit per second; DELAY in us, ms or s)"
    ]
