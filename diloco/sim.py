"""diloco-sim: a coordinator and N islands as separate processes on one machine, over gRPC on 127.0.0.1.

Prints one line per round and a summary. It only launches `python -m coordinator`
and `python -m islands` and watches the coordinator over the public protocol,
so it exercises exactly what a multi-site deployment runs.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from diloco.cli import ArgumentParser, add_config_flags, config_from_args, fail
from diloco.config import RunConfig
from diloco.data import entropy_floor
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    report: dict
    seconds: float
    island_exit_codes: list[int]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def _wait_for_port(port_file: Path, proc: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with status {proc.returncode} before serving")
        time.sleep(0.1)
    raise TimeoutError(f"coordinator did not start within {timeout_s:.0f}s")


def run_sim(
    cfg: RunConfig,
    islands: int,
    workdir: Path,
    timeout_s: float = 1800.0,
    threads: int = 1,
    echo=print,
    extra_island_args: list[str] | None = None,
) -> SimResult:
    """Runs the simulation to the end; raises if it fails or outlives timeout_s."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "run.toml"
    config_path.write_text(cfg.to_toml())
    port_file, report_path = workdir / "port", workdir / "report.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    python = [sys.executable, "-m"]
    started = time.monotonic()
    coordinator = subprocess.Popen(
        python + ["coordinator", "serve", "--config", str(config_path), "--host", "127.0.0.1", "--port", "0",
                  "--port-file", str(port_file), "--report", str(report_path), "--linger", "20",
                  "--threads", str(threads), "--log-level", "warning"],
        env=env, stdout=open(workdir / "coordinator.log", "w"), stderr=subprocess.STDOUT,
    )
    procs: list[subprocess.Popen] = []
    try:
        port = _wait_for_port(port_file, coordinator, 120)
        address = f"127.0.0.1:{port}"
        for i in range(islands):
            procs.append(subprocess.Popen(
                python + ["islands", "join", "--coordinator", address, "--config", str(config_path),
                          "--threads", str(threads), "--device", "cpu", "--log-level", "warning"] + (extra_island_args or []),
                env=env, stdout=open(workdir / f"island-{i}.log", "w"), stderr=subprocess.STDOUT,
            ))
        _watch(address, cfg, islands, echo, started, timeout_s)
        remaining = max(1.0, timeout_s - (time.monotonic() - started))
        codes = [p.wait(remaining) for p in procs]
        coordinator.wait(60)
    finally:
        for p in procs + [coordinator]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if coordinator.returncode != 0:
        raise RuntimeError(f"coordinator exited with status {coordinator.returncode}; see {workdir / 'coordinator.log'}")
    bad = [i for i, c in enumerate(codes) if c != 0]
    if bad:
        raise RuntimeError(f"islands {bad} failed; see {workdir}/island-N.log")
    report = json.loads(report_path.read_text())
    return SimResult(report, time.monotonic() - started, codes)


def _watch(address: str, cfg: RunConfig, islands: int, echo, started: float, timeout_s: float) -> None:
    """Prints one line per closed round until the run finishes."""
    echo(f"{'round':>5} {'islands':>7} {'train':>7} {'eval':>7} {'up':>10} {'down':>10} {'secs':>6}")
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        remaining = timeout_s - (time.monotonic() - started)
        for s in stub.WatchRounds(pb.WatchRequest(from_round=0), timeout=remaining):
            eval_text = "-" if math.isnan(s.eval_loss) else f"{s.eval_loss:.4f}"
            echo(
                f"{s.round:>5} {len(s.islands):>7} {s.train_loss:>7.4f} {eval_text:>7} "
                f"{_fmt_bytes(s.bytes_up):>10} {_fmt_bytes(s.bytes_down):>10} {s.seconds:>6.1f}"
            )
            if s.run_finished:
                return


def summarize(result: SimResult, cfg: RunConfig, echo=print) -> None:
    rep = result.report
    rounds = rep["rounds"]
    evals = [r["eval_loss"] for r in rounds if r["eval_loss"] is not None]
    up = sum(r["bytes_up"] for r in rounds)
    down = sum(r["bytes_down"] for r in rounds)
    echo("")
    echo(f"finished {len(rounds)} rounds in {result.seconds:.1f}s")
    if evals and rep["initial_eval_loss"] is not None:
        echo(f"eval loss of the global parameters: {rep['initial_eval_loss']:.4f} -> {evals[-1]:.4f}")
    floor = entropy_floor(cfg.data)
    if floor is not None and evals:
        echo(f"entropy floor of the synthetic language: {floor:.4f} nats/token (gap {evals[-1] - floor:.4f})")
    echo(f"bytes up {_fmt_bytes(up)}, down {_fmt_bytes(down)}")
    matches = sum(1 for c in rep["islands"].values() if c == rep["checksum"])
    echo(f"islands holding the coordinator's global parameters: {matches}/{len(rep['islands'])} (checksum {rep['checksum'][:12]})")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="diloco-sim",
        description="Simulate a multi-island DiLoCo run on one machine: a coordinator and N islands as processes over gRPC on 127.0.0.1.",
    )
    parser.add_argument("--islands", type=int, default=4, help="number of islands (default 4)")
    add_config_flags(parser)
    parser.add_argument("--rounds", type=int, help="override rounds.rounds")
    parser.add_argument("--workdir", help="where logs, the resolved config and the report go (default: a temp dir)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds (default 1800)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.islands < 1:
        fail(parser.prog, "--islands must be at least 1")
    if args.rounds is not None:
        args.overrides.append(f"rounds.rounds={args.rounds}")
    # Every island starts in round 0 and owns its own shard of the data.
    args.overrides = [f"rounds.min_islands={args.islands}", f"data.shards={args.islands}"] + args.overrides
    cfg = config_from_args(parser.prog, args)
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="diloco-sim-"))
    print(f"diloco-sim: {args.islands} islands, {cfg.rounds.rounds} rounds of H={cfg.inner.steps_per_round}, "
          f"config {cfg.name!r} (logs in {workdir})", flush=True)
    try:
        result = run_sim(cfg, args.islands, workdir, args.timeout, args.threads, echo=lambda s: print(s, flush=True))
    except (RuntimeError, TimeoutError, grpc.RpcError) as e:
        fail(parser.prog, f"simulation failed: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130)
    summarize(result, cfg)


if __name__ == "__main__":
    main()
