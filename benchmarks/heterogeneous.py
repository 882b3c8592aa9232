"""Islands that differ: fixed H against time-boxed rounds, late contributions and per-link codecs.

Two (or more) islands and a coordinator as separate processes
(`islands.sim.simulation.Simulation`, what `diloco-sim` runs), each island
behind its own emulated WAN link (`islands.sim.wan.WanLink`) of its own rate;
the last island is throttled (seconds slept in every inner step, as if on a
slower device: --slowdown 2 makes it about half as fast as the others, from a
step of the model timed here first).
Every method trains the same model on the same data (the time-boxed ones for
--time-rounds, about as long as fixed H's --rounds); they differ in how rounds
are paced:

- fixed: every island trains H inner steps a round (today's default): the
  fast islands wait for the slow one every round.
- time: `rounds.mode = "time"`: every island trains for `rounds.round_s`
  seconds a round (at most 3H steps), so the fast ones do more steps.
- late: time, plus `rounds.late_rounds = 3`: a round closes at its deadline
  (round_s x (1 + --grace)) and a push that misses it by up to 3 rounds is
  folded into the current round at weight x 0.5 ** staleness
  (`rounds.late_discount`) instead of holding every island back.
- overlap: late, plus `streaming.tau = --tau` (2): the island trains on while
  its exchange is in flight and mixes the result in tau steps later, so the
  transfer and the coordinator's close are hidden behind inner steps.
- dn: overlap with `rounds.late_mode = "delayed_nesterov"` in place of the
  discount folded into the round's Nesterov step (diloco/outer.py).
- codecs: overlap, plus compression per link: `wire.link_codecs = [fp32, bf16,
  int8, e3m0]`, the coordinator advising each island the least lossy that fits
  `wire.link_fraction` of the round's time on its link (error feedback on).

Reported per method: each island's compute utilization (time in inner steps,
throttle included, over its wall time) and inner steps, the eval loss of the
global parameters at equal wall time (the shortest run's duration, from the
coordinator's start), the wall time to reach a target eval loss (default: the
fixed-H run's final one), bytes through each island's link, and the late folds.

Run from the repository root:  python -m benchmarks.heterogeneous   (--quick: a smoke test)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diloco.config import RunConfig, load_config
from diloco.data.sources import StepIndexedStream
from diloco.inner import build_inner_optimizer, train_step
from diloco.models.llama import Transformer
from islands.sim.simulation import Simulation
from islands.sim.wan import parse_link

log = logging.getLogger("heterogeneous-bench")

METHODS = ("fixed", "time", "late", "overlap", "dn", "codecs")
NAMES = {"fixed": "fixed H (today)", "time": "time-boxed", "late": "time-boxed + late contributions",
         "overlap": "time-boxed + late + overlap", "dn": "time-boxed + late (delayed Nesterov) + overlap",
         "codecs": "time-boxed + late + overlap + per-link codecs"}
LATE = ("late", "overlap", "dn", "codecs")


@dataclass
class RunResult:
    method: str
    utilization: list[float]  # per island
    inner_steps: list[int]
    evals: list[tuple[float, float]]  # (seconds since the run started, eval loss) after each round
    wall_s: float  # the run, coordinator start to the last round's close
    bytes: list[tuple[int, int]]  # per island link: up, down
    late_folds: int
    codecs: dict = field(default_factory=dict)  # island -> codecs its contributions came in
    load: tuple[float, float] = (0.0, 0.0)

    def loss_at(self, t: float) -> float | None:
        """The eval loss of the last round closed by t seconds."""
        before = [loss for s, loss in self.evals if s <= t]
        return before[-1] if before else None

    def time_to(self, target: float) -> float | None:
        return next((s for s, loss in self.evals if loss <= target), None)


def step_seconds(cfg: RunConfig, steps: int = 12) -> float:
    """One unthrottled inner step of this model on one thread, measured here (after 3 warm-up steps)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        optimizer = build_inner_optimizer(model, cfg.inner)
        stream = StepIndexedStream(cfg.data, cfg.seed, 0, cfg.data.shards)
        for s in range(3 + steps):
            if s == 3:
                started = time.perf_counter()
            train_step(model, optimizer, stream.batch_at(s, cfg.inner.batch_size), cfg.inner.lr, cfg.inner.grad_clip)
        return (time.perf_counter() - started) / steps
    finally:
        torch.set_num_threads(threads)


def island_ids(workdir: Path, islands: int) -> list[str]:
    """The coordinator's id of each simulated island (ids go by join order, not by the sim's index)."""
    ids = []
    for i in range(islands):
        found = re.search(r"islands: (\S+) finished at round", (workdir / f"island-{i}.log").read_text())
        ids.append(found.group(1) if found else f"island-{i}")
    return ids


def method_config(method: str, args: argparse.Namespace) -> RunConfig:
    rounds = args.rounds if method == "fixed" else args.time_rounds
    o = [
        "name='heterogeneous-bench'", f"inner.steps_per_round={args.h}", f"rounds.rounds={rounds}",
        f"rounds.min_islands={args.islands}", f"data.shards={args.islands}", "rounds.lease_s=120", "rounds.heartbeat_s=1",
        f"eval.batches={args.eval_batches}", "eval.batch_size=16", "eval.every_rounds=1", "inner.warmup_steps=20",
        "outer.lr=0.7", "outer.momentum=0.9", "limits.idle_rounds=0",
    ]
    if args.quick:
        o += ["model.d_model=64", "model.n_layers=2", "model.d_ff=172", "model.max_seq_len=64", "data.seq_len=64"]
    if method == "fixed":
        o += ["rounds.deadline_s=600"]
    else:
        o += ["rounds.mode='time'", f"rounds.round_s={args.round_s:.3f}", f"inner.max_steps={3 * args.h}"]
        o += [f"rounds.deadline_s={args.round_s * (1 + args.grace):.3f}" if method in LATE else "rounds.deadline_s=600"]
    if method in LATE:  # a deadline closes a round with the islands that made it (min_islands 1)
        o += [f"rounds.late_rounds={args.late_rounds}", f"rounds.late_discount={args.late_discount}", "rounds.min_islands=1"]
    if method in ("overlap", "dn", "codecs"):
        o += [f"streaming.tau={args.tau}"]
    if method == "dn":
        o += ["rounds.late_mode='delayed_nesterov'"]
    if method == "codecs":
        o += ["wire.link_codecs=['fp32', 'bf16', 'int8', 'e3m0']", f"wire.link_fraction={args.link_fraction}",
              "wire.error_feedback=true"]
    return load_config(None, o + list(args.overrides))


def run_one(method: str, args: argparse.Namespace, workdir: Path) -> RunResult:
    cfg = method_config(method, args)
    links = [parse_link(f"{rate}:{args.delay}") for rate in args.links]
    slow = {args.islands - 1: ["--throttle", str(args.throttle)]} if args.throttle else {}
    load_before = os.getloadavg()[0]
    log.info("%s: %d islands on %s, the last throttled by %gs a step ...", method, args.islands, ",".join(args.links), args.throttle)
    sim = Simulation(cfg, args.islands, workdir / method, threads=1, wan=links, island_args=slow)
    summaries = []
    try:
        started = time.time()
        sim.start()
        cores = sorted(os.sched_getaffinity(0))
        if args.pin and len(cores) >= 2:
            for i, proc in sim.island_procs.items():
                os.sched_setaffinity(proc.pid, {cores[i % len(cores)]})
        summaries = list(sim.watch(args.timeout))
        result = sim.finish(args.timeout)
    finally:
        sim.close()
    stats = result.report["island_stats"]
    ids = island_ids(workdir / method, args.islands)  # in the sim's order: link i, the last one throttled
    codecs: dict[str, list[str]] = {}
    for s in summaries:
        for c in s.contributions:
            name = f"#{ids.index(c.island_id)}" if c.island_id in ids else c.island_id
            if c.codec not in codecs.setdefault(name, []):
                codecs[name].append(c.codec)
    run = RunResult(
        method, [stats[i]["compute_s"] / stats[i]["wall_s"] for i in ids], [int(stats[i]["inner_steps"]) for i in ids],
        [(s.closed_at - started, s.eval_loss) for s in summaries if s.eval_loss == s.eval_loss],
        max(s.closed_at for s in summaries) - started, result.wan_bytes, result.report["events"].get("late_folded", 0),
        codecs, (load_before, os.getloadavg()[0]),
    )
    log.info("%s: utilization %s, steps %s, final eval %.4f after %.0fs, %d late folds", method,
             ", ".join(f"{100 * u:.1f}%" for u in run.utilization), run.inner_steps, run.evals[-1][1], run.wall_s, run.late_folds)
    return run


def markdown(results: list[RunResult], args: argparse.Namespace, command: str, wall: float) -> str:
    cfg = method_config("fixed", args)
    params = Transformer(cfg.model).num_parameters()
    equal = min(r.wall_s for r in results)
    base = next((r for r in results if r.method == "fixed"), results[0])
    target = args.target or base.evals[-1][1]
    lines = [
        f"{args.islands} islands on emulated links of {', '.join(args.links)} (one per island, one-way delay {args.delay}); the "
        f"last island sleeps {args.throttle:.3f} s in every inner step ({args.slowdown:g}x slower; a step took {args.step_s:.3f} s "
        f"measured alone). Synthetic language, "
        f"{params / 1e6:.2f}M parameters ({4 * params / 1e6:.1f} MB in fp32), batch {cfg.inner.batch_size} x seq_len "
        f"{cfg.data.seq_len} per island and step; fixed H = {args.h}, {args.rounds} rounds; {args.time_rounds} time-boxed rounds of "
        f"{args.round_s:.2f} s (at most {3 * args.h} steps); late: deadline round_s x {1 + args.grace:g}, late_rounds "
        f"{args.late_rounds}, discount {args.late_discount:g} per round; overlap tau {args.tau}; per-link codecs: "
        f"link_fraction {args.link_fraction:g}. Eval loss at equal wall time: at {equal:.0f} s (the shortest run); "
        f"target eval loss {target:.4f}{' (fixed H final)' if not args.target else ''}. {os.cpu_count()} CPU cores shared "
        "by islands, coordinator and links, one torch thread per process.",
        "",
        "| method | utilization per island (#0, #1, ...) | inner steps per island | eval loss at equal wall time | wall time to target | "
        "final eval loss (wall time) | MB up / down per island link | late folds | codecs used |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        at = r.loss_at(equal)
        to = r.time_to(target)
        lines.append(
            f"| {NAMES[r.method]} | {', '.join(f'{100 * u:.1f}%' for u in r.utilization)} | {', '.join(map(str, r.inner_steps))} "
            f"| {f'{at:.4f}' if at is not None else '—'} | {f'{to:.0f} s' if to is not None else 'not reached'} "
            f"| {r.evals[-1][1]:.4f} ({r.wall_s:.0f} s) | {', '.join(f'{u / 1e6:.1f} / {d / 1e6:.1f}' for u, d in r.bytes)} "
            f"| {r.late_folds} | {'; '.join(i + ': ' + '/'.join(c) for i, c in sorted(r.codecs.items()))} |"
        )
    loads = [x for r in results for x in r.load]
    lines += ["", f"Wall time {wall / 60:.1f} min; 1-minute load average {min(loads):.1f}..{max(loads):.1f}.", "",
              f"Command: `{command}`"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heterogeneous", description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--islands", type=int, default=2, help="islands (default 2); the last one is throttled")
    p.add_argument("--links", default="1gbit,20mbit", help="link rate per island, comma-separated (default 1gbit,20mbit)")
    p.add_argument("--delay", default="25ms", help="one-way delay of every link (default 25ms)")
    p.add_argument("--slowdown", type=float, default=2.0, help="the last island is this many times slower (default 2)")
    p.add_argument("--rounds", type=int, default=30, help="rounds of the fixed-H run (default 30)")
    p.add_argument("--time-rounds", type=int, default=60, help="rounds of the time-boxed runs (default 60): about as long")
    p.add_argument("--h", type=int, default=20, help="fixed H (default 20)")
    p.add_argument("--round-s", type=float, default=0.0, help="time-boxed round, seconds (default: H unthrottled steps)")
    p.add_argument("--grace", type=float, default=0.05, help="late: a round's deadline is round_s x (1 + grace) (default 0.05)")
    p.add_argument("--late-rounds", type=int, default=3, help="late: rounds.late_rounds (default 3)")
    p.add_argument("--late-discount", type=float, default=0.5, help="late: rounds.late_discount (default 0.5)")
    p.add_argument("--link-fraction", type=float, default=0.25, help="per-link codecs: share of the round a push may take")
    p.add_argument("--tau", type=int, default=2, help="overlap: inner steps an exchange runs behind (default 2)")
    p.add_argument("--target", type=float, default=0.0, help="target eval loss (default: the fixed-H run's final one)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--workdir", help="logs of every run (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1200.0, help="per run (default 1200 s)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin island i to core i")
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    p.add_argument("--json", metavar="PATH", help="write every run's figures here")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    args.links = [x.strip() for x in args.links.split(",") if x.strip()]
    args.links = [args.links[i % len(args.links)] for i in range(args.islands)]
    if args.quick:
        args.rounds, args.time_rounds, args.h = 4, 4, 5
    args.step_s = step_seconds(method_config("fixed", args))
    args.throttle = (args.slowdown - 1) * args.step_s
    args.round_s = args.round_s or args.h * args.step_s
    log.info("an inner step takes %.3fs here: the last island sleeps %.3fs a step; time-boxed rounds of %.2fs",
             args.step_s, args.throttle, args.round_s)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="diloco-heterogeneous-"))
    log.info("heterogeneous benchmark: methods %s; logs in %s", ",".join(args.methods), workdir)
    started = time.monotonic()
    results = [run_one(method, args, workdir) for method in args.methods]
    wall = time.monotonic() - started
    print(markdown(results, args, "python -m benchmarks.heterogeneous" + (" " + " ".join(argv) if argv else ""), wall))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "wall_s": wall, "runs": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
