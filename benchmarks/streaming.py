"""Streaming DiLoCo benchmark: compute utilization and eval loss over emulated WAN links.

For each link (default 1gbit, 100mbit, 10mbit, one-way delay 25 ms: about a
round trip between two data centres on one continent), two islands and a
coordinator run as separate processes (`islands.sim.simulation.Simulation`, exactly what
`diloco-sim` runs), each island behind its own `islands.sim.wan.WanLink` to the
coordinator, training the same byte-level Transformer on tinyshakespeare with
the same inner AdamW for the same number of inner steps T:

- ddp: per-step synchronization through the coordinator, the DDP equivalent:
  H = 1, outer SGD with lr 1 and no momentum, fp32 both ways, so every inner
  step ends with theta_global = the token-weighted mean of the islands' new
  parameters (each island's own AdamW state, fed its own gradients: not
  bit-for-bit DDP with gradient all-reduce, but the same traffic, full model
  up and down every step, and the same synchronization).
- diloco: plain DiLoCo, H inner steps per round, outer Nesterov lr 0.7
  momentum 0.9, fp32 both ways, blocking exchange.
- streaming: Streaming DiLoCo, P fragments (strided), overlap tau = 1, alpha
  (default 0.5), 4-bit e3m0 pseudo-gradients with island-side error feedback
  and e3m0 updates down (coordinator-side error feedback), same H and outer
  optimizer as diloco.

Compute utilization = time inside inner steps / island wall time, measured by
each island (wall time runs from the first inner step, after the initial fetch
of the global parameters, to the landing of the last result; waiting for
results, the outer-step bookkeeping on the island and everything else count
against it), averaged over the two islands. Eval loss is that of the final
global parameters, measured by the coordinator on fixed held-out batches.

Per-step synchronization pushes and pulls the whole fp32 model every step, so
on the slow links it runs only its first --ddp-steps steps (utilization is
per step the same all along); its eval loss is taken from the full run on the
fastest link: with fixed seeds the arithmetic does not depend on the link (the
diloco and streaming rows show it: their losses agree across links).

Each island process is pinned to a CPU core of its own (--no-pin leaves them to
the scheduler); the coordinator and the link proxies run wherever there is room.

Run from the repository root:  python -m benchmarks.streaming
(22-28 minutes on 2 CPU cores shared with other work; --quick is a smoke test
of about 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from diloco.config import RunConfig, load_config
from diloco.models.llama import Transformer
from islands.sim.simulation import SimResult, Simulation
from islands.sim.wan import WanSpecError, parse_link

REPO_ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("streaming-bench")

DEFAULT_DATA = "../shared/data/tinyshakespeare.txt"
METHODS = ("ddp", "diloco", "streaming")
NAMES = {
    "ddp": "per-step sync (DDP equivalent, fp32)",
    "diloco": "DiLoCo (fp32, blocking)",
    "streaming": "Streaming DiLoCo (overlap, 4-bit)",
}


@dataclass
class RunResult:
    method: str
    link: str
    steps: int  # inner steps each island ran
    utilization: list[float]  # per island
    step_s: list[float]  # mean seconds per inner step, per island
    wait_s: list[float]  # seconds blocked on results, per island
    straggler_s: list[float]  # of which the coordinator held the island's pulls for the other island's pushes
    steady: list[float]  # utilization from the end of the first round to the start of the last (per island)
    wall_s: list[float]  # island wall time
    eval_loss: float | None
    sim_s: float  # the whole simulation, process start-up included
    bytes_up: int
    bytes_down: int
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average before and after
    extra: dict = field(default_factory=dict)

    @property
    def mean_utilization(self) -> float:
        return statistics.fmean(self.utilization)



def base_overrides(args: argparse.Namespace) -> list[str]:
    data = Path(args.data).expanduser()
    data = data if data.is_absolute() else (REPO_ROOT / data).resolve()
    if not data.is_file():
        raise SystemExit(f"streaming: error: data file not found: {data}")
    if args.quick:
        model = ["model.d_model=64", "model.n_layers=4", "model.n_heads=2", "model.d_ff=256", "model.max_seq_len=64"]
        seq_len = 64
    else:
        model = [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}", "model.n_heads=4",
                 f"model.d_ff={4 * args.d_model}", "model.max_seq_len=128"]
        seq_len = 128
    return [
        "name='streaming-bench'", "data.source='text'", f"data.path='{data}'", f"data.seq_len={seq_len}",
        "data.shards=2", "model.vocab_size=256", *model,
        f"inner.lr={args.lr}", f"inner.warmup_steps={args.warmup}", "inner.min_lr_ratio=0.1", f"inner.batch_size={args.batch}",
        "rounds.min_islands=2", "rounds.deadline_s=3600", "rounds.lease_s=120", "rounds.heartbeat_s=2",
        f"eval.batches={args.eval_batches}", "eval.batch_size=16", "eval.every_rounds=1000000",
    ]


def method_config(method: str, args: argparse.Namespace, steps: int) -> RunConfig:
    o = base_overrides(args)
    if method == "ddp":
        o += ["inner.steps_per_round=1", f"rounds.rounds={steps}", "outer.lr=1.0", "outer.momentum=0.0",
              "outer.nesterov=false", "wire.codec='fp32'"]
    elif method == "diloco":
        o += [f"inner.steps_per_round={args.h}", f"rounds.rounds={steps // args.h}", "outer.lr=0.7", "outer.momentum=0.9",
              "wire.codec='fp32'"]
    else:
        o += [f"inner.steps_per_round={args.h}", f"rounds.rounds={steps // args.h}", "outer.lr=0.7", "outer.momentum=0.9",
              f"streaming.fragments={args.fragments}", "streaming.tau=1", f"streaming.alpha={args.alpha}",
              f"wire.codec='{args.codec}'", "wire.error_feedback=true"]
    cfg = load_config(None, o + list(args.overrides))
    return cfg


def simulate(cfg: RunConfig, workdir: Path, spec, args: argparse.Namespace) -> SimResult:
    """islands.sim.simulation.run_sim, with each island pinned to a core of its own (--pin): as if in its own data centre."""
    sim = Simulation(cfg, 2, workdir, threads=1, wan=[spec, spec])
    try:
        sim.start()
        cores = sorted(os.sched_getaffinity(0))
        if args.pin and len(cores) >= 2:
            for i, proc in sim.island_procs.items():
                os.sched_setaffinity(proc.pid, {cores[i % len(cores)]})
        for _ in sim.watch(args.timeout):
            pass
        return sim.finish(args.timeout)
    finally:
        sim.close()


def run_one(method: str, link: str, steps: int, args: argparse.Namespace, workdir: Path) -> RunResult:
    cfg = method_config(method, args, steps)
    spec = parse_link(f"{link}:{args.delay}")
    load_before = os.getloadavg()[0]
    log.info("%s on %s: %d inner steps ...", method, spec, steps)
    result = simulate(cfg, workdir / f"{method}-{link}", spec, args)
    report = result.report
    stats = list(report["island_stats"].values())
    evals = [r["eval_loss"] for r in report["rounds"] if r["eval_loss"] is not None]
    run = RunResult(
        method, link, steps,
        [s["compute_s"] / s["wall_s"] for s in stats],
        [s["compute_s"] / s["inner_steps"] for s in stats],
        [s["wait_s"] for s in stats],
        [s["straggler_s"] for s in stats],
        [s["steady_compute_s"] / s["steady_wall_s"] for s in stats if s.get("steady_wall_s")],
        [s["wall_s"] for s in stats],
        evals[-1] if evals else None,
        result.seconds,
        sum(r["bytes_up"] for r in report["rounds"]),
        sum(r["bytes_down"] for r in report["rounds"]),
        (load_before, os.getloadavg()[0]),
    )
    log.info(
        "%s on %s: utilization %.1f%% (%s), %.3f s/step, eval %s, %.0fs", method, link, 100 * run.mean_utilization,
        ", ".join(f"{100 * u:.1f}%" for u in run.utilization), statistics.fmean(run.step_s),
        f"{run.eval_loss:.4f}" if run.eval_loss is not None else "-", run.sim_s,
    )
    return run


def markdown(results: list[RunResult], args: argparse.Namespace, links: list[str], wall: float, command: str) -> str:
    cfg = method_config("streaming", args, args.steps)
    m = cfg.model
    params = Transformer(m).num_parameters()
    full_loss = {r.method: r.eval_loss for r in results if r.steps == args.steps and r.eval_loss is not None}
    header = (
        f"Two islands on emulated links of 1 Gbit/s, 100 Mbit/s and 10 Mbit/s (one-way delay {args.delay}, one link per "
        f"island, `islands.sim.wan.WanLink`); byte-level Transformer, {params / 1e6:.2f}M parameters ({4 * params / 1e6:.1f} MB "
        f"in fp32; d_model {m.d_model}, {m.n_layers} layers, d_ff {m.d_ff}), seq_len {cfg.data.seq_len}, batch "
        f"{cfg.inner.batch_size} per island, T = {args.steps} inner steps, H = {args.h}; Streaming: {args.fragments} "
        f"fragments (strided), tau = 1, alpha = {args.alpha:g}, {args.codec} both ways. Islands, coordinator and links "
        f"share the machine's {os.cpu_count()} CPU cores, one torch thread per process"
        f"{', each island pinned to a core of its own' if args.pin else ''}.\n"
    )
    rows = [
        "| method | link | compute utilization, whole run (per island) | steady state (steps H..T−H) | "
        "waiting for results, of which for the other island | s per inner step | eval loss | vs DiLoCo |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = full_loss.get("diloco")
    for method in args.methods:
        for link in links:
            r = next((x for x in results if x.method == method and x.link == link), None)
            if r is None:
                continue
            loss = r.eval_loss if r.steps == args.steps else full_loss.get(method)
            loss_text = "—" if loss is None else (f"{loss:.4f}" if r.steps == args.steps else f"{loss:.4f}†")
            vs = "—" if loss is None or base is None or method == "diloco" else f"{100 * (loss - base) / base:+.2f}%"
            per = ", ".join(f"{100 * u:.1f}%" for u in r.utilization)
            steps = "" if r.steps == args.steps else f" ({r.steps} steps)"
            rows.append(
                f"| {NAMES[method]} | {link}{steps} | **{100 * r.mean_utilization:.1f}%** ({per}) "
                f"| {f'{100 * statistics.fmean(r.steady):.1f}%' if r.steady else '—'} "
                f"| {statistics.fmean(r.wait_s):.1f} s of {statistics.fmean(r.wall_s):.0f} s, {statistics.fmean(r.straggler_s):.1f} s "
                f"| {statistics.fmean(r.step_s):.3f} | {loss_text} | {vs} |"
            )
    notes = [
        "",
        "Whole run: from each island's first inner step (after its initial fetch) to its last result landing, "
        "so it includes the islands' different start times (the first syncs wait for the later one) and the final "
        "wave, where every fragment syncs at once with nothing left to overlap. Steady state: the same ratio from the "
        "end of the first round to the boundary at T−H, which is what a long run converges to (empty for runs of "
        "fewer than three rounds). Waiting for the other island: the part of an island's blocked time during which "
        "the coordinator held its pull for the other island's push (ResultHeader.held_s): load imbalance between the "
        "islands (CPU contention on the shared cores), not communication.",
        f"† per-step synchronization ran only its first {args.ddp_steps} steps on the slower links; its eval loss is that "
        f"of the full run on {links[0]} (the arithmetic does not depend on the link).",
        "",
        "Targets:",
    ]
    s100 = next((r for r in results if r.method == "streaming" and r.link == "100mbit"), None)
    d100 = next((r for r in results if r.method == "diloco" and r.link == "100mbit"), None)
    if s100 and d100:
        ok = s100.mean_utilization >= 0.97 and d100.mean_utilization < s100.mean_utilization
        steady = (f"; steady state {100 * statistics.fmean(s100.steady):.1f}% vs {100 * statistics.fmean(d100.steady):.1f}%"
                  if s100.steady and d100.steady else "")
        notes.append(f"- Streaming with overlap >= 97% utilization at 100 Mbit/s, plain DiLoCo clearly lower: "
                     f"{'MET' if ok else 'NOT MET'} over the whole run ({100 * s100.mean_utilization:.1f}% vs "
                     f"{100 * d100.mean_utilization:.1f}%{steady})")
    if full_loss.get("streaming") is not None and base is not None:
        diff = 100 * (full_loss["streaming"] - base) / base
        notes.append(f"- Streaming eval loss within 1% of plain DiLoCo at tau = 1: {'MET' if abs(diff) <= 1 or diff < 0 else 'NOT MET'} "
                     f"({full_loss['streaming']:.4f} vs {base:.4f}, {diff:+.2f}%)")
    loads = [x for r in results for x in r.load]
    notes += ["", f"Wall time {wall / 60:.1f} min; 1-minute load average during the runs {min(loads):.1f}..{max(loads):.1f} "
                  f"on {os.cpu_count()} cores (other work shared the machine).", "", f"Command: `{command}`"]
    return "\n".join([header, *rows, *notes])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--links", default="1gbit,100mbit,10mbit", help="link rates, fastest first (default 1gbit,100mbit,10mbit)")
    p.add_argument("--delay", default="25ms", help="one-way delay of every link (default 25ms)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--steps", type=int, default=200, help="T, inner steps per island (default 200)")
    p.add_argument("--ddp-steps", type=int, default=6, help="steps of per-step sync on the slower links (default 6)")
    p.add_argument("--h", type=int, default=25, help="H, inner steps per round (default 25)")
    p.add_argument("--fragments", type=int, default=4, help="Streaming fragments P (default 4)")
    p.add_argument("--alpha", type=float, default=0.5, help="Streaming mixing factor (default 0.5)")
    p.add_argument("--codec", default="e3m0", help="Streaming codec, both ways (default e3m0)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per island per inner step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--data", default=DEFAULT_DATA, help=f"text file, relative to the repo root (default {DEFAULT_DATA})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra RunConfig override for every run (repeatable)")
    p.add_argument("--workdir", help="logs of every run (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run (default 1800 s)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin island i to core i (default: pinned, each island on a core of its own)")
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration")
    p.add_argument("--json", metavar="PATH", help="write every run's figures here")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    if args.quick:
        args.steps, args.h, args.ddp_steps = 40, 10, 4
    try:
        for link in links:
            parse_link(f"{link}:{args.delay}")
    except WanSpecError as e:
        raise SystemExit(f"streaming: error: {e}") from None
    if args.steps % args.h:
        raise SystemExit(f"streaming: error: --steps {args.steps} must be a multiple of --h {args.h}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="diloco-streaming-"))
    log.info("streaming benchmark: methods %s, links %s (delay %s), T=%d, H=%d; logs in %s",
             ",".join(args.methods), ",".join(links), args.delay, args.steps, args.h, workdir)
    started = time.monotonic()
    results: list[RunResult] = []
    for i, link in enumerate(links):
        for method in args.methods:
            steps = args.steps if method != "ddp" or i == 0 else args.ddp_steps
            results.append(run_one(method, link, steps, args, workdir))
    wall = time.monotonic() - started
    command = "python -m benchmarks.streaming" + (" " + " ".join(argv) if argv else "")
    print(markdown(results, args, links, wall, command))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "wall_s": wall, "runs": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
