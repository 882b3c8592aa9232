"""The command lines of the benchmarks (`python -m benchmarks.NAME`) and of the attack probe (`python -m tests.probes.attack`):
a bad argument is a one-line error before any run starts, and the smallest run of each prints what the docs cite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("topk@bogus", "bad suffix @bogus; suffixes are"),
        ("topk@dx", "bad suffix @dx"),
        ("topk@d2", "wire.topk_density must be in (0, 1]"),
        ("topk@noef@carry", "wire.feedback_in_model keeps the error-feedback residual in the model: it needs error feedback"),
        ("int9", "unknown codec 'int9'"),
    ],
)
def test_convergence_refuses_a_bad_codec_spec(spec, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.convergence", "--methods", "", "--codecs", spec],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"convergence: error: --codecs {spec}: ") and message in last, run.stderr[-500:]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sizes", "5m"], "--sizes: unknown size '5m'; choose from 1m, 25m, 125m, 350m"),
        (["--islands", "two"], "--islands: expected numbers such as 1,2,4,8"),
        (["--codecs", "int9"], "--codecs: unknown codec 'int9'"),
        (["--wan", "fast"], "--wan: bad link 'fast'"),
        (["--stagger", "-1"], "--stagger must be between 0 and 600 seconds, got -1"),
        (["--set", "limits.spool_memory=0"], "--set: unknown key(s) ['spool_memory'] in [limits]"),
    ],
)
def test_exchange_benchmark_refuses_bad_input_in_one_line(args, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.exchange", *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("exchange: error: ") and message in lines[0], run.stderr[-500:]


def test_exchange_benchmark_moves_the_same_bytes_as_its_bare_transfer(tmp_path):
    """The smallest point, end to end: islands end on the coordinator's parameters, and the bare
    transfer it is compared with moves the bytes the exchange moved (up to the push header)."""
    out = tmp_path / "exchange.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.exchange", "--sizes", "1m", "--islands", "2",
                          "--codecs", "int8", "--repeat", "1", "--set", "limits.spool_memory_models=0", "--json", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert (row["islands"], row["codec"]) == (2, "int8") and 0.9e6 < row["parameters"] < 1.1e6
    for direction in ("up", "down"):
        exchanged, bare = row[f"bytes_{direction}_per_island"], row[f"bare_bytes_{direction}_per_island"]
        assert abs(exchanged - bare) <= 0.01 * bare, (direction, exchanged, bare)
    assert row["exchange_s"] > 0 and row["bare_s"] > 0 and row["coordinator_peak_rss"] > 0
    # Where the time went: the islands' push and pull, the coordinator's own fold, step and publication timings.
    assert all(0 < row[k] < 600 for k in ("push_s", "fold_s", "step_s", "publish_s", "pull_s")), row
    # The CPU the exchange and the bare transfer took, the coordinator's part, and the least ratio they allow.
    assert 0 < row["coordinator_cpu_s"] <= row["exchange_cpu_s"] and row["bare_cpu_s"] > 0, row
    assert row["cpu_floor_ratio"] == pytest.approx(row["exchange_cpu_s"] / row["cores"] / row["bare_s"]), row
    assert row["settings"] == ["limits.spool_memory_models=0"], row
    assert "| 1.0M | int8 | 2 |" in run.stdout


def test_data_benchmark_prepares_reads_and_feeds_from_disk_and_s3():
    shared = ROOT.parent / "shared" / "data"
    if not (shared / "wikitext2-valid.txt").exists():
        pytest.skip(f"needs the shared data folder ({shared})")
    pytest.importorskip("moto.server", reason="install the test extras: pip install -e '.[test]'")
    run = subprocess.run([sys.executable, "-m", "benchmarks.data", "--vocab-size", "1024", "--workers", "1",
                          "--loader-steps", "5", "--batch", "4"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("prepare (1 workers, ") and "tokens/s" in lines[0]
    for kind in ("reads", "loader"):
        for where in ("local", "s3"):
            for state in ("cold", "warm"):
                assert any(line.startswith(f"{kind} {where:5s} {state}: first ") for line in lines), (kind, where, state, lines)


@pytest.mark.slow  # the probes it runs are each asserted by tests/test_attacks_*.py in the default suite
def test_attack_benchmark_shows_each_attack_of_issue_15_refused():
    run = subprocess.run([sys.executable, "-m", "tests.probes.attack"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    imposter, off, on, flood, idle, public = run.stdout.strip().splitlines()
    assert imposter.endswith("plaintext: accepted; mutual TLS: refused (PERMISSION_DENIED NOT_YOURS)")
    assert "30 joined as mallory, 32 refused RESOURCE_EXHAUSTED RATE_LIMITED; islands in the run after it: 1" in flood
    assert flood.endswith("joined as ['east', 'west']")
    held = [float(s) for s in idle.split("seconds per round ")[1].split(";")[0].split()]
    assert len(held) == 7 and all(s >= 2.0 for s in held[:4]) and "removed idle: 1" in idle  # after: tests/test_limits.py
    assert public.startswith("plaintext on 0.0.0.0: refused")
    assert off.startswith("robust.enabled=False: the 1e9-token claim accepted") and off.endswith("clipped: none")
    assert "claim refused (INVALID_ARGUMENT)" in on and on.endswith("clipped: ['island-1']")


@pytest.mark.slow  # a 2-round demo measured twice: about 2 minutes on 2 cores
def test_observe_cost_benchmark_reports_each_shares():
    run = subprocess.run([sys.executable, "-m", "benchmarks.observe_cost", "--rounds", "2", "--islands", "2",
                          "--every", "0.5", "--island-rounds", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("demo: 2 islands, 2 rounds, codec e3m0+zstd, mean round ")
    assert any(line.strip().startswith("coordinator /api/run") and "requests, median" in line for line in lines)
    coordinator = next(line for line in lines if line.startswith("coordinator: "))
    island = next(line for line in lines if line.startswith("island: telemetry hooks "))
    for line in (coordinator, island):
        share = float(line.split("= ")[-1].split("%")[0])
        assert 0 < share < 100, line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--shards", "0"], "--shards must be at least 1, got 0"),
        (["--sizes", "5m"], "--sizes: unknown size '5m'; choose from 1m, 25m, 125m, 350m, 530m"),
    ],
)
def test_shards_benchmark_refuses_bad_input_in_one_line(args, message):
    run = subprocess.run([sys.executable, "-m", "benchmarks.shards", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shards: error: ") and message in lines[0], run.stderr[-500:]


def test_shards_benchmark_measures_each_shard(tmp_path):
    """The smallest point, end to end: two shard processes, two islands ending on one joined checksum, and figures
    for each shard (its memory, its CPU, the bytes the islands exchanged with it)."""
    out = tmp_path / "shards.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.shards", "--sizes", "1m", "--shards", "2", "--islands", "2",
                          "--repeat", "1", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert (row["shards"], row["islands"]) == (2, 2) and 0.9e6 < row["parameters"] < 1.1e6
    assert [p["shard"] for p in row["per_shard"]] == [0, 1]
    assert sum(p["parameters"] for p in row["per_shard"]) == row["parameters"]
    for p in row["per_shard"]:
        assert p["bytes_up"] > 0 and p["bytes_down"] > 0 and p["peak_rss"] > 0 and p["cpu_s"] > 0, p
    assert row["peak_rss_sum"] == sum(p["peak_rss"] for p in row["per_shard"]) and row["exchange_s"] > 0
    assert "| 1.0M | fp32 | 2 | 2 |" in run.stdout
