"""What watching a run costs: the dashboard, metrics and logs against the demo's round time (issue 16, item 6).

Runs the demo (`diloco-sim`'s config: the tiny model, 4-bit both ways with zstd,
4 islands) with everything on: the coordinator's dashboard polled every 2 s as the
page does (/api/run, only new rounds), its /metrics and every island's /metrics
scraped every 2 s (Prometheus' usual interval is 15 s), JSON lines per round and
per window of inner steps. Then measures, per round:

- coordinator: the seconds its HTTP port spent answering (each request's latency,
  an upper bound on the server's work), and RunLog.record of the run's own
  summaries with JSON lines and TensorBoard on;
- island: the telemetry hooks of H inner steps and one landing, with metrics,
  JSON lines and TensorBoard on.

Each as a share of the demo's mean round time (coordinator) or island round time.

Run from the repository root:  python -m benchmarks.observe_cost [--rounds 8]   (about a minute)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from coordinator.runlog import RunLog
from diloco.config import load_config
from islands.sim.cli import DEMO_WIRE
from islands.sim.simulation import Simulation
from islands.telemetry import IslandTelemetry, TelemetryOptions


def _poll(urls: dict[str, str], every_s: float, stop: threading.Event, latencies: dict[str, list[float]]) -> None:
    since = 0
    while not stop.wait(every_s):
        for label, url in urls.items():
            target = url.replace("since=0", f"since={since}")
            started = time.perf_counter()
            try:
                body = urllib.request.urlopen(target, timeout=10).read()
            except OSError:
                continue  # the run is ending
            latencies.setdefault(label, []).append(time.perf_counter() - started)
            if "api/run" in url:
                since = int(json.loads(body)["next_since"])


class _Timed(IslandTelemetry):
    """The island's telemetry, timing its own hooks (they run on the island's threads)."""

    spent = 0.0

    def _timed(self, hook, *args) -> None:
        started = time.perf_counter()
        hook(*args)
        self.spent += time.perf_counter() - started

    def inner_step(self, *args) -> None:
        self._timed(super().inner_step, *args)

    def landed(self, *args) -> None:
        self._timed(super().landed, *args)

    def _on_call(self, *args) -> None:
        self._timed(super()._on_call, *args)


def island_hook_share(overrides: list[str], rounds: int = 10) -> tuple[float, float]:
    """One island trained in this process with metrics, JSON lines and TensorBoard on: (seconds in the telemetry
    hooks, wall seconds of its run)."""
    from coordinator.server import start_coordinator
    from islands.client import CoordinatorClient
    from islands.island import Island
    from islands.world import IslandWorld

    # One island: its first outer step needs no second (robust.first_quorum, as diloco-sim sets for one island).
    cfg = load_config(None, [*overrides, f"rounds.rounds={rounds}", "rounds.min_islands=1", "data.shards=1",
                             "robust.first_quorum=1"])
    tmp = Path(tempfile.mkdtemp(prefix="diloco-observe-"))
    coordinator = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp / "spool"))
    world = IslandWorld.init("cpu")
    client = CoordinatorClient(f"127.0.0.1:{coordinator.port}", connect_timeout_s=10)
    telemetry = _Timed(TelemetryOptions(metrics_port=0, log_url=str(tmp / "logs"), tensorboard_dir=str(tmp / "tb")))
    try:
        island = Island(cfg, world, client, client.join(cfg.digest()))
        island.telemetry = telemetry
        started = time.perf_counter()
        island.run()
        return telemetry.spent, time.perf_counter() - started
    finally:
        telemetry.close()
        client.close()
        world.shutdown()
        coordinator.stop(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between polls of each URL (default 2)")
    parser.add_argument("--island-rounds", type=int, default=10, help="rounds of the one island whose hooks are timed")
    args = parser.parse_args()
    overrides = [f"rounds.min_islands={args.islands}", f"data.shards={args.islands}", *DEMO_WIRE, f"rounds.rounds={args.rounds}"]
    cfg = load_config(None, overrides)
    workdir = Path(tempfile.mkdtemp(prefix="diloco-observe-"))
    sim = Simulation(cfg, args.islands, workdir)
    latencies: dict[str, list[float]] = {}
    stop = threading.Event()
    summaries = []
    try:
        sim.start()
        urls = {"coordinator /api/run": f"{sim.dashboard_url}api/run?since=0",
                "coordinator /metrics": f"{sim.dashboard_url}metrics",
                **{f"island-{i} /metrics": f"http://127.0.0.1:{p}/metrics" for i, p in sorted(sim.metrics_ports.items())}}
        poller = threading.Thread(target=_poll, args=(urls, args.every, stop, latencies), daemon=True)
        poller.start()
        for summary in sim.watch(600):
            summaries.append(summary)
        stop.set()
        poller.join(15)
        result = sim.finish(600)
    finally:
        stop.set()
        sim.close()

    round_s = statistics.mean(s.seconds for s in summaries[1:] or summaries)  # round 0 includes start-up
    run_s = sum(s.seconds for s in summaries)
    tmp = Path(tempfile.mkdtemp(prefix="diloco-observe-"))
    runlog = RunLog(str(tmp / "logs"), str(tmp / "tb"), cfg)
    started = time.perf_counter()
    for _ in range(20):
        for s in summaries:
            runlog.record(s)
    record_s = (time.perf_counter() - started) / (20 * len(summaries))
    runlog.close()

    print(f"demo: {args.islands} islands, {len(summaries)} rounds, codec {cfg.wire.codec}+zstd, mean round {round_s:.3f} s "
          f"(run {result.seconds:.1f} s); polls every {args.every:g} s")
    coordinator_s = record_s * len(summaries)
    for label, values in latencies.items():
        print(f"  {label:22s} {len(values):3d} requests, median {statistics.median(values) * 1e3:.2f} ms, "
              f"max {max(values) * 1e3:.2f} ms")
        if label.startswith("coordinator"):
            coordinator_s += sum(values)
    print(f"  RunLog.record (JSON lines + TensorBoard): {record_s * 1e3:.3f} ms a round")
    print(f"coordinator: {coordinator_s:.3f} s of {run_s:.1f} s of rounds = {100 * coordinator_s / run_s:.2f}% "
          f"(dashboard polls + its metrics scrapes + round logs)")
    scrapes = [x for label, v in latencies.items() if label.startswith("island") for x in v]
    scrape_share = statistics.mean(scrapes) / args.every if scrapes else 0.0  # one scrape every `every` seconds
    hooks_s, wall_s = island_hook_share(overrides, args.island_rounds)
    print(f"island: telemetry hooks {hooks_s * 1e3:.1f} ms of a {wall_s:.1f} s run ({100 * hooks_s / wall_s:.3f}%) + "
          f"its /metrics answered {100 * scrape_share:.3f}% of the time = {100 * (hooks_s / wall_s + scrape_share):.2f}%")


if __name__ == "__main__":
    main()
