"""One-island throughput: tokens/s of the inner steps and MFU against the card's bf16 peak.

Starts a real coordinator on 127.0.0.1 (in this process, `start_coordinator`,
as the tests do) and one one-rank island as a subprocess running the real
`diloco-island join` path (`python -m islands join --device ...`), which
adopts the coordinator's config. The run is --rounds rounds of
--steps-per-round inner steps; evaluation is off (eval.batches=0, before any
--set) so the coordinator does not compete for the host's cores.

What is measured: the island times each inner step itself (islands/island.py:
data is fetched before the clock starts; on CUDA the clock starts after a
device synchronize and `train_step` ends with `loss.item()`, which waits for
the step's kernels, the optimizer's included) and, at leave, reports the sum
over its steady window, rounds 2..R-1 (the first round is warm-up: allocator,
cuBLAS/SDPA kernel selection; the last one ends in the island's final landing).
From that:

    tokens/s   = steady steps * batch_size * seq_len / steady compute seconds
    step time  = steady compute seconds / steady steps
    MFU        = tokens/s * FLOPs per token / peak bf16 dense FLOP/s
    FLOPs/token = 6 * N + 12 * n_layers * d_model * seq_len   (PaLM, appendix B)

with N every parameter, the tied embedding counted once (it is the LM head's
matmul; the lookup costs nothing): `Transformer.flops_per_token`. The island's
wall-clock throughput over the same rounds (exchanges with the coordinator
included) is reported beside it. On CUDA the one-rank island computes under
bf16 autocast over fp32 master weights (diloco/inner.py compute_precision);
--compile adds torch.compile (the warm-up round pays the compilation).

Run from the repository root on a GPU machine:
    python -m benchmarks.island_throughput --device cuda --rounds 5 --steps-per-round 20 --json out.json
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from coordinator.server import Coordinator, start_coordinator
from diloco.cli.common import ArgumentParser, add_config_flags, fail, setup_logging
from diloco.config import ConfigError, RunConfig, load_config
from diloco.models.llama import Transformer

REPO_ROOT = Path(__file__).resolve().parent.parent

PROG = "island_throughput"
log = logging.getLogger(PROG)

# Dense bf16 tensor-core peaks (no sparsity), first match on torch.cuda.get_device_name().
PEAK_BF16: list[tuple[str, float]] = [
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b", 989.4e12),  # SXM, "NVIDIA H100 80GB HBM3"
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bH200\b", 989.4e12),
    (r"\bA100\b", 312e12),
    (r"\bL4\b", 121e12),
]


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog=PROG, description="Tokens/s and MFU of one one-GPU island against a local coordinator.")
    add_config_flags(p)
    p.set_defaults(config="configs/125m.toml")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="island device (default auto)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, >= 3: the first is warm-up, the last excluded (default 5)")
    p.add_argument("--steps-per-round", type=int, default=20, metavar="H", help="inner steps per round (default 20)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: from the device name)")
    p.add_argument("--threads", type=int, default=0, help="island torch CPU threads (default: torch's choice)")
    p.add_argument("--compile", action="store_true", help="torch.compile the island's model (diloco-island join --compile)")
    p.add_argument("--timeout", type=float, default=1800.0, metavar="S", help="give up after S seconds (default 1800)")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    return p


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        fail(PROG, f"--device cuda, but torch {torch.__version__} sees no CUDA device")
    return choice


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def peak_flops(name: str, device: str, peak_tflops: float | None) -> float | None:
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device != "cuda":
        return None
    for pattern, peak in PEAK_BF16:
        if re.search(pattern, name):
            return peak
    fail(PROG, f"no bf16 peak known for {name!r}; pass --peak-tflops")


def load(args) -> RunConfig:
    path = Path(args.config)
    if not path.is_file() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    # One island: its first outer step has no second to wait for (robust.first_quorum, as diloco-sim sets for one).
    forced = [f"rounds.rounds={args.rounds}", f"inner.steps_per_round={args.steps_per_round}", "robust.first_quorum=1"]
    try:
        # The synthetic language at the preset's shapes: throughput needs no corpus (--set data.* to read one).
        synthetic = ["data.source=synthetic", "model.vocab_size=50304"]
        return load_config(path, ["eval.batches=0", *synthetic, *args.overrides, *forced])
    except ConfigError as e:
        fail(PROG, str(e))


def run_island(coordinator: Coordinator, device: str, threads: int, deadline: float, workdir: Path, compile_model: bool) -> dict:
    """Runs `diloco-island join` to the end of the run; returns the stats it reported when leaving."""
    cmd = [sys.executable, "-m", "islands", "join", "--coordinator", f"127.0.0.1:{coordinator.port}",
           "--device", device, "--threads", str(threads), "--connect-timeout", "60", "--log-level", "info"] + (["--compile"] if compile_model else [])
    log_path = workdir / "island.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        code = proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the island did not finish in time; see {log_path}") from None
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    if code != 0:
        tail = log_path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"the island exited with status {code}: {tail[0]} (log: {log_path})")
    coordinator.wait(max(1.0, min(30.0, deadline - time.monotonic())))
    stats = list(coordinator.report()["island_stats"].values())
    if len(stats) != 1:
        raise RuntimeError(f"expected one island's stats at the coordinator, got {len(stats)} (log: {log_path})")
    return stats[0]


def figures(cfg: RunConfig, stats: dict, name: str, device: str, peak: float | None, command: str) -> dict:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = Transformer(cfg.model)
    seq, batch, h = cfg.data.seq_len, cfg.inner.batch_size, cfg.inner.steps_per_round
    steps = (cfg.rounds.rounds - 2) * h
    compute_s, wall_s = stats.get("steady_compute_s", 0.0), stats.get("steady_wall_s", 0.0)
    if stats.get("inner_steps", 0) != cfg.rounds.rounds * h or compute_s <= 0:
        raise RuntimeError(f"the island did not report a full steady window: {stats}")
    tokens_per_s = steps * batch * seq / compute_s
    flops_per_token = model.flops_per_token(seq)
    return {
        "device": device, "device_name": name, "preset": cfg.name, "params": model.num_parameters(),
        "batch_size": batch, "seq_len": seq, "rounds": cfg.rounds.rounds, "steps_per_round": h, "steady_steps": steps,
        "steady_compute_s": compute_s, "steady_wall_s": wall_s,
        "tokens_per_s": tokens_per_s, "step_time_s": compute_s / steps,
        "wall_tokens_per_s": steps * batch * seq / wall_s if wall_s > 0 else None,
        "flops_per_token": flops_per_token,
        "flops_formula": "6*N + 12*n_layers*d_model*seq_len (N: all parameters, tied embedding once)",
        "peak_flops": peak, "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "island_stats": stats, "command": command,
    }


def markdown(f: dict) -> str:
    mfu = f"{100 * f['mfu']:.1f}%" if f["mfu"] is not None else "n/a (no peak for CPU; pass --peak-tflops)"
    head = "| device | preset | params | batch x seq | tokens/s | step time | MFU |"
    row = (f"| {f['device_name']} | {f['preset']} | {f['params'] / 1e6:.1f}M | {f['batch_size']} x {f['seq_len']} | "
           f"{f['tokens_per_s']:,.0f} | {1e3 * f['step_time_s']:.1f} ms | {mfu} |")
    wall = f"{f['wall_tokens_per_s']:,.0f}" if f["wall_tokens_per_s"] else "n/a"
    peak = f"{f['peak_flops'] / 1e12:.1f} TFLOP/s bf16 dense" if f["peak_flops"] else "none"
    notes = [
        f"steady window: rounds 2..{f['rounds'] - 1} of {f['rounds']}, {f['steady_steps']} inner steps "
        f"({f['steady_compute_s']:.2f}s in steps, {f['steady_wall_s']:.2f}s wall; {wall} tokens/s with exchanges)",
        f"FLOPs/token = {f['flops_formula']} = {f['flops_per_token'] / 1e9:.3f} GFLOP; peak {peak}",
        f"command: {f['command']}",
    ]
    return "\n".join([head, "|---|---|---|---|---|---|---|", row, ""] + notes)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.rounds < 3:
        fail(PROG, f"--rounds must be >= 3 (first round warm-up, last excluded), got {args.rounds}")
    if args.steps_per_round < 1 or args.timeout <= 0:
        fail(PROG, "--steps-per-round and --timeout must be positive")
    setup_logging("info", PROG)
    cfg = load(args)
    device = resolve_device(args.device)
    name = device_name(device)
    peak = peak_flops(name, device, args.peak_tflops)
    command = shlex.join(["python", "-m", "benchmarks.island_throughput", *(sys.argv[1:] if argv is None else argv)])
    deadline = time.monotonic() + args.timeout
    workdir = Path(tempfile.mkdtemp(prefix="island-throughput-"))
    coordinator = None
    try:
        coordinator = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(workdir / "spool"))
        log.info("%s: %d rounds x %d steps of %s on %s", PROG, cfg.rounds.rounds, args.steps_per_round, cfg.name, name)
        stats = run_island(coordinator, device, args.threads, deadline, workdir, args.compile)
        result = figures(cfg, stats, name, device, peak, command)
    except RuntimeError as e:
        fail(PROG, str(e))
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; island log and spool in {workdir}\n")
        raise SystemExit(130) from None
    finally:
        if coordinator is not None:
            coordinator.stop(1.0)
    shutil.rmtree(workdir, ignore_errors=True)  # kept (with the island's log) when the run failed
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
