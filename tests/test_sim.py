"""A 3-island run over real gRPC, each island and the coordinator in its own process."""

from __future__ import annotations

import re
import time

import pytest

from conftest import tiny_config
from diloco.jsonlog import read_log
from islands.sim.simulation import run_sim

pytestmark = pytest.mark.integration


def test_three_island_sim_ends_with_identical_parameters_and_lower_eval_loss(tmp_path):
    cfg = tiny_config(
        "rounds.rounds=4", "rounds.min_islands=3", "data.shards=3", "inner.steps_per_round=5",
        "inner.lr=1e-2", "inner.warmup_steps=2", "eval.batches=4",
    )
    lines = []
    result = run_sim(cfg, islands=3, workdir=tmp_path, timeout_s=240, echo=lines.append)
    report = result.report
    assert [r["round"] for r in report["rounds"]] == [0, 1, 2, 3]
    assert all(len(r["islands"]) == 3 for r in report["rounds"])
    # Every island left holding exactly the coordinator's final global parameters.
    assert len(report["islands"]) == 3
    assert set(report["islands"].values()) == {report["checksum"]}
    assert report["rounds"][-1]["checksum"] == report["checksum"]
    assert report["rounds"][-1]["eval_loss"] < report["initial_eval_loss"] - 0.3
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in report["rounds"])
    assert lines[0].startswith("dashboard: http://127.0.0.1:") and lines[0].endswith("/metrics")
    assert lines[1].startswith("island metrics: ") and lines[1].count("/metrics") == 3
    assert len(lines) == 3 + 4  # where to look, header + one line per round
    # The JSON lines: one file per process (the coordinator's, each island's), every round's record in it.
    assert sorted(re.sub(r"-\d{8}T\d{6}\.jsonl$", "", p.name) for p in (tmp_path / "logs").iterdir()) == [
        "island-0", "island-1", "island-2", "rounds"]
    logged = read_log(str(tmp_path / "logs"), "rounds")
    assert [r["round"] for r in logged if r["event"] == "round"] == [0, 1, 2, 3]


def test_island_metrics_ports_lie_below_the_ephemeral_range_and_apart():
    """The simulation picks each island's metrics port below the range the kernel hands to outgoing connections
    (one of those took an island's port between its choice and the island's bind, and the run waited for that island
    for ever), with room for an FSDP island's port + g, and apart from the ports chosen before."""
    import socket

    from islands.sim.simulation import ephemeral_ports, free_port

    low, chosen = ephemeral_ports().start, []
    for _ in range(20):
        port = free_port(chosen)
        assert 1024 <= port and port + 15 < low, (port, low)
        assert all(abs(port - other) >= 16 for other in chosen), (port, chosen)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out
        chosen.append(port)


def test_an_island_that_fails_ends_the_simulation_at_once_naming_it(tmp_path):
    """An island exiting with an error of its own (here a bad flag) would hold every round until the timeout: the
    simulation stops as soon as it sees the exit, with the island's last log line."""
    import pytest

    from islands.sim.simulation import Simulation

    cfg = tiny_config("rounds.rounds=3", "rounds.min_islands=2", "data.shards=2")
    sim = Simulation(cfg, 2, tmp_path, island_args={1: ["--throttle", "-1"]})
    try:
        sim.start()
        with pytest.raises(RuntimeError) as e:
            for _ in sim.watch(600):
                pass
    finally:
        sim.close()
    assert "island 1 exited with status 2" in str(e.value) and "--throttle" in str(e.value)
    assert time.monotonic() - sim.started < 300  # far from the 600 s it would have waited


def test_a_coordinator_that_cannot_start_ends_the_simulation_with_its_own_error(tmp_path):
    """`diloco-sim` said only "coordinator exited with status 2 before serving" while the reason sat in the
    coordinator's log (a temporary folder by default): the simulation's error carries the coordinator's own error
    line, once, though each of a sharded coordinator's shards says it."""
    from islands.sim.simulation import Simulation

    cfg = tiny_config("data.source=tokens", f"data.url={str(tmp_path / 'not-prepared')!r}", "model.vocab_size=0")
    sim = Simulation(cfg, 1, tmp_path / "sim", coordinator_shards=2)
    try:
        with pytest.raises(RuntimeError) as e:
            sim.start()
    finally:
        sim.close()
    message = str(e.value)
    assert "coordinator exited with status 2 before serving" in message
    assert "no manifest.json" in message and "diloco-data prepare" in message, message
    assert message.count("no manifest.json") == 1, message
