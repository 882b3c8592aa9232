"""Convergence benchmark: DiLoCo against DDP, a single island and FedAvg at equal tokens.

Every method trains the same byte-level `diloco.models.llama.Transformer` on
tinyshakespeare with the same inner optimizer (`diloco.inner`: AdamW, warmup +
cosine indexed by the inner step across the whole run, gradient clipping) for
the same number of inner steps T, and is scored by the eval loss of its final
(global) parameters on the same fixed held-out batches (`diloco.data.sources.eval_batches`,
the last 10% of the file). A global batch of B sequences is split B/M across
M islands; each island reads its own disjoint shard of the training split
(`diloco.data.sources.train_stream(cfg.data, seed, shard, M)`: every M-th 4 KiB stripe).
With --tokens URL every method reads a token corpus (`diloco-data prepare`) in
place of the bytes: the islands read disjoint position ranges of its samples as
the coordinator's leases would (benchmarks/convergence_data.py), the eval is its
eval split, and the vocabulary is its manifest's.

- ddp: one model trained with batch B for T steps. Its batch is the
  concatenation of the M shard streams' B/M-sequence batches, so it sees exactly
  the tokens DiLoCo and FedAvg see. The mean loss over that batch has the
  gradient that data-parallel training with gradient averaging over M workers
  (B/M each, then clipping and one AdamW step) computes, so this *is* DDP,
  run in one process.
- diloco: M islands, each with its own persistent AdamW state (never reset),
  train H inner steps of batch B/M from theta_global; the pseudo-gradients
  theta_global - theta_local (fp32, `diloco.outer.pseudo_gradient`) are
  judged by the norm guard, token-weighted-averaged and applied to the fp32
  global parameters by the outer optimizer (SGD, Nesterov, lr 0.7, momentum 0.9),
  all by `diloco.aggregate`, the functions the coordinator's rounds call;
  the islands then adopt the new global parameters. T/H rounds.
- fedavg: the same loop with outer lr 1 and momentum 0, i.e. plain averaging.
- single: one island alone: batch B/M on shard 0 of M for T steps, so it sees
  1/M of the tokens.

This is an in-process simulation of the arithmetic the coordinator and islands
run over gRPC: the same modules, no networking (the pseudo-gradients go through
`diloco.wire.messages` chunks and `coordinator.publish`, so --codecs measures the codecs
exactly as deployed). Independent (method, seed) jobs
run in a spawn-context process pool, one torch thread each.

Run from the repository root:  python -m benchmarks.convergence
(about 20-25 minutes on 2 idle CPU cores; --quick is a smoke test of under a minute).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diloco.cli.common import fail
from diloco.config import ConfigError, RunConfig, load_config
from diloco.data.sources import Batch, eval_batches
from diloco.inner import build_inner_optimizer, evaluate, inner_lr, train_step
from diloco.models.llama import Transformer
from diloco.outer import pseudo_gradient
from diloco.params import fp32_copy
from diloco.data.shards import DataError

# Beside this file (split from it to keep each file short).
from benchmarks.convergence_data import corpus_vocab, data_overrides, island_streams
from benchmarks.convergence_report import markdown, summarize
from benchmarks.convergence_wire import CODEC_FLAGS, Wire, apply_codec_spec  # noqa: F401  (CODEC_FLAGS: re-exported)

log = logging.getLogger("convergence")

DEFAULT_DATA = "../shared/data/tinyshakespeare.txt"
METHODS = ("ddp", "diloco", "fedavg", "single")
# Outer settings fixed by the benchmark's spec.
OUTER = {"diloco": (0.7, 0.9), "fedavg": (1.0, 0.0)}


@dataclass(frozen=True)
class Setup:
    """Everything a (method, seed) job needs; picklable for the process pool."""

    overrides: tuple[str, ...]  # RunConfig overrides shared by every method
    steps: int  # T: inner steps per model (per island for diloco/fedavg)
    batch: int  # B: global batch in sequences
    islands: int  # M
    eval_batches: int
    eval_batch_size: int
    eval_every: int  # steps between eval checkpoints (a multiple of H)

    def config(self, seed: int) -> RunConfig:
        return load_config(None, [*self.overrides, f"seed={seed}"])


@dataclass
class JobResult:
    method: str
    seed: int
    final_eval: float
    curve: list[tuple[int, float]]  # (inner step, eval loss)
    tokens: int
    seconds: float
    final_train: float
    bytes_up: int = 0  # per island per round (diloco, fedavg)
    bytes_down: int = 0


# --- configuration ----------------------------------------------------------------


def build_setup(args: argparse.Namespace) -> Setup:
    source = data_overrides(args.tokens, args.data)
    if args.quick:
        model = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32"]
        seq_len, steps, batch, eval_n, eval_bs = 32, 100, 8, 4, 16
    else:
        # Small enough that T = 6000 inner steps (120 rounds of H = 50) fit in ~20 minutes
        # on 2 cores. The round count is what matters: DiLoCo's outer Nesterov momentum
        # (0.9) averages over ~10 rounds, and with 8-32 rounds it trails even FedAvg
        # (measured: +10% vs DDP at 8 rounds, +6.5% at 32, +2.7% at 60, +0.2% at 120).
        model = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=256", "model.max_seq_len=64"]
        seq_len, steps, batch, eval_n, eval_bs = 64, 6000, 32, 16, 32
    steps = args.steps or steps
    batch = args.batch or batch
    h = args.h
    if steps % h:
        raise SystemExit(f"convergence: error: --steps {steps} must be a multiple of H={h}")
    if batch % args.islands:
        raise SystemExit(f"convergence: error: --batch {batch} must be divisible by M={args.islands}")
    overrides = [
        *source,
        f"data.seq_len={seq_len}",
        f"data.shards={args.islands}",
        "model.vocab_size=0" if args.tokens else "model.vocab_size=256",
        *model,
        f"inner.lr={args.lr}",
        f"inner.warmup_steps={args.warmup}",
        f"inner.min_lr_ratio={args.min_lr_ratio}",
        f"inner.batch_size={batch // args.islands}",
        f"inner.steps_per_round={h}",
        *args.overrides,
    ]
    if args.tokens:  # the model's vocabulary is the corpus's
        try:
            vocab = corpus_vocab(load_config(None, overrides))
        except (ConfigError, DataError) as e:
            fail("convergence", f"--tokens {args.tokens}: {e}")
        overrides[overrides.index("model.vocab_size=0")] = f"model.vocab_size={vocab}"
    eval_every = max(h, (steps // 4) // h * h)
    setup = Setup(tuple(overrides), steps, batch, args.islands, eval_n, eval_bs, eval_every)
    setup.config(0)  # validate once, here, with a readable error
    return setup


# --- shared pieces -----------------------------------------------------------------


def new_model(cfg: RunConfig) -> Transformer:
    """The run's starting point: the same init for every method at a given seed."""
    torch.manual_seed(cfg.seed)
    return Transformer(cfg.model)


@torch.no_grad()
def load_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        p.copy_(params[name].to(p.dtype))


def concat_batches(batches: list[Batch]) -> Batch:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


# --- methods ---------------------------------------------------------------------


def run_single_model(
    cfg: RunConfig, setup: Setup, next_batch: Callable[[], Batch], evaluate_at: Callable[[int, torch.nn.Module], None]
) -> float:
    """T steps of one model (ddp or single island); returns the mean train loss of the last H steps."""
    model = new_model(cfg)
    optimizer = build_inner_optimizer(model, cfg.inner)
    h = cfg.inner.steps_per_round
    losses: list[float] = []
    for step in range(setup.steps):
        lr = inner_lr(step, setup.steps, cfg.inner)
        losses.append(train_step(model, optimizer, next_batch(), lr, cfg.inner.grad_clip))
        evaluate_at(step + 1, model)
    return sum(losses[-h:]) / h


def run_ddp(cfg: RunConfig, setup: Setup, evaluate_at: Callable[[int, torch.nn.Module], None]) -> float:
    streams = island_streams(cfg, setup.islands)
    per_island = setup.batch // setup.islands
    return run_single_model(cfg, setup, lambda: concat_batches([s.next_batch(per_island) for s in streams]), evaluate_at)


def run_single(cfg: RunConfig, setup: Setup, evaluate_at: Callable[[int, torch.nn.Module], None]) -> float:
    (stream,) = island_streams(cfg, setup.islands, [0])
    per_island = setup.batch // setup.islands
    return run_single_model(cfg, setup, lambda: stream.next_batch(per_island), evaluate_at)


def run_outer(
    cfg: RunConfig, setup: Setup, evaluate_at: Callable[[int, torch.nn.Module], None]
) -> tuple[float, int, int]:
    """DiLoCo / FedAvg (by cfg.outer): M islands, T/H rounds of H inner steps, one outer step per round.

    Returns the last round's mean train loss and the bytes sent up and down per island per round.
    """
    h = cfg.inner.steps_per_round
    per_island = setup.batch // setup.islands
    tokens_per_round = h * per_island * cfg.data.seq_len
    start = new_model(cfg)
    wire = Wire(cfg, fp32_copy(start), setup.islands)  # the coordinator's side: guard, fold, outer step, publication
    global_params = wire.publication.params  # what the islands hold
    models = [new_model(cfg) for _ in range(setup.islands)]
    optimizers = [build_inner_optimizer(m, cfg.inner) for m in models]
    streams = island_streams(cfg, setup.islands)
    round_losses: list[float] = []
    rounds = setup.steps // h
    clipped = 0
    for round_ in range(rounds):
        round_losses = []
        pushed = []
        lr_sum = sum(inner_lr(round_ * h + i, setup.steps, cfg.inner) for i in range(h))  # the guard judges norm / lr_sum
        for island, (model, optimizer, stream) in enumerate(zip(models, optimizers, streams)):
            feedback = wire.feedback[island]
            load_params(model, global_params)  # theta_local <- theta_global; AdamW state kept
            if feedback is not None and feedback.in_model:  # ... less what the codec did not send
                feedback.keep_residual_(dict(model.named_parameters()))
            for i in range(h):
                step = round_ * h + i
                lr = inner_lr(step, setup.steps, cfg.inner)
                round_losses.append(train_step(model, optimizer, stream.next_batch(per_island), lr, cfg.inner.grad_clip))
            pushed.append(wire.push(island, pseudo_gradient(global_params, dict(model.named_parameters())), tokens_per_round, lr_sum))
        clipped += wire.round(pushed, setup.islands)
        global_params = wire.publication.params
        load_params(start, global_params)  # evaluate what the islands hold
        evaluate_at((round_ + 1) * h, start)
    per = rounds * setup.islands
    log.info("norm guard (robust.enabled=%s): %d of %d contributions clipped or dropped; the least cosine between two "
             "islands' pushes of a round: %.3f", cfg.robust.enabled, clipped, per, wire.least_cosine)
    return sum(round_losses) / len(round_losses), wire.bytes_up // per, wire.bytes_down // per


def tokens_processed(method: str, setup: Setup, seq_len: int) -> int:
    per_step = setup.batch if method != "single" else setup.batch // setup.islands
    return setup.steps * per_step * seq_len


def run_job(job: tuple[str, int, Setup]) -> JobResult:
    """One (method, seed) run in a worker process."""
    method, seed, setup = job
    cfg = setup.config(seed)
    base, _, codecs = method.partition(":")
    if base in OUTER:
        lr, momentum = OUTER[base]
        cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov = lr, momentum, True
    if codecs:
        apply_codec_spec(cfg, codecs)
    held_out = eval_batches(cfg.data, setup.eval_batches, setup.eval_batch_size, cfg.model.vocab_size)
    curve: list[tuple[int, float]] = []
    started = time.monotonic()

    def evaluate_at(step: int, model: torch.nn.Module) -> None:
        if step % setup.eval_every == 0 or step == setup.steps:
            loss = evaluate(model, held_out)
            curve.append((step, loss))
            log.info("%-6s seed %d step %4d/%d eval %.4f (%.0fs)", method, seed, step, setup.steps, loss, time.monotonic() - started)

    runner = {"ddp": run_ddp, "single": run_single, "diloco": run_outer, "fedavg": run_outer}[base]
    result = runner(cfg, setup, evaluate_at)
    final_train, up, down = result if isinstance(result, tuple) else (result, 0, 0)
    return JobResult(method, seed, curve[-1][1], curve, tokens_processed(base, setup, cfg.data.seq_len),
                     time.monotonic() - started, final_train, up, down)


# --- orchestration and reporting ------------------------------------------------------------------


def init_worker(level: int) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(stream=sys.stderr, level=level, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")


def job_cost(method: str, setup: Setup) -> float:
    return 1.0 / setup.islands if method == "single" else 1.0


def run_all(setup: Setup, methods: list[str], seeds: list[int], workers: int,
            skip: set[tuple[str, int]] = frozenset()) -> list[JobResult]:
    jobs = [(m, s, setup) for s in seeds for m in methods if (m, s) not in skip]
    jobs.sort(key=lambda j: -job_cost(j[0], setup))  # longest first: better packing
    level = logging.getLogger().level
    if workers <= 1:
        init_worker(level)
        return [run_job(j) for j in jobs]
    with mp.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(level,)) as pool:
        return list(pool.imap_unordered(run_job, jobs))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convergence", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA, help=f"text file, relative to the repo root (default {DEFAULT_DATA})")
    p.add_argument("--tokens", metavar="URL", help="train on this token corpus (diloco-data prepare's output: a local path, "
                   "relative to the repo root, or an fsspec URL) in place of --data's bytes; the vocabulary is its manifest's")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, help="T, inner steps per model (default 6000; 100 with --quick)")
    p.add_argument("--batch", type=int, help="global batch B in sequences (default 32; 8 with --quick)")
    p.add_argument("--islands", type=int, default=4, help="M (default 4)")
    p.add_argument("--h", type=int, default=50, help="H, inner steps per round (default 50)")
    p.add_argument("--lr", type=float, default=6e-3, help="inner peak lr, the same for all methods (default 6e-3)")
    p.add_argument("--warmup", type=int, default=100, help="inner warmup steps (default 100)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of lr (default 0.1)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--codecs", default="", metavar="UP[/DOWN],...",
                   help="also run DiLoCo with these codecs up (and down; default the same), e.g. e3m0+zstd,topk/int8; "
                        "suffixes: @ef turns on the islands' error feedback (on for topk unless @noef), @dDENSITY sets the top-k "
                        "density, @bBITS the top-k value bits, @decayD the error-feedback decay, @carry keeps the residual in the island's "
                        "model (wire.feedback_in_model), @lrLR / @mM the outer lr / momentum, @sgd outer lr 1 without momentum (SparseLoCo), "
                        "@muon Muon as the inner optimizer (fp32@muon: Muon without compression)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra RunConfig override applied to every method (repeatable)")
    p.add_argument("--quick", action="store_true", help="tiny smoke configuration (under a minute)")
    p.add_argument("--json", metavar="PATH", help="write per-seed results and summaries here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--reuse", action="append", default=[], metavar="PATH",
                   help="reuse (method, seed) runs from an earlier --json of this benchmark with an identical setup "
                        "(runs are deterministic: one torch thread, fixed seeds); repeatable")
    return p


def reusable_runs(paths: list[str], setup: Setup) -> dict[tuple[str, int], JobResult]:
    """Runs from earlier JSON reports whose setup equals this one; any other report is an error."""
    wanted = json.loads(json.dumps(asdict(setup)))
    runs: dict[tuple[str, int], JobResult] = {}
    for path in paths:
        try:
            payload = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"convergence: error: --reuse {path}: {e}") from None
        if payload.get("setup") != wanted:
            raise SystemExit(f"convergence: error: --reuse {path} was run with a different setup; "
                             "rerun with the same flags or leave it out")
        for r in payload["runs"]:
            r["curve"] = [tuple(point) for point in r["curve"]]
            runs[(r["method"], r["seed"])] = JobResult(**r)
    return runs


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    methods = [m for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not seeds:
        raise SystemExit(f"convergence: error: unknown methods {unknown} or no seeds")
    methods = [m for m in METHODS if m in methods]
    # The source the run will read, as build_setup sets it (not yet looked for), so that --set keys of that source
    # are checked as acting on it.
    if args.tokens:
        source = ["data.source='tokens'", f"data.url={args.tokens!r}", "model.vocab_size=0"]
    else:
        source = ["data.source='text'", f"data.path={args.data!r}", "model.vocab_size=256"]
    for spec in filter(None, args.codecs.split(",")):
        try:  # before the data is looked for: a bad spec is the user's first error to hear about
            apply_codec_spec(load_config(None, [*source, *args.overrides]), spec)
        except ValueError as e:
            raise SystemExit(f"convergence: error: --codecs {spec}: {e}") from None
        methods.append(f"diloco:{spec}")
    setup = build_setup(args)
    cfg = setup.config(seeds[0])
    log.info("convergence: %s x seeds %s, T=%d, B=%d, M=%d, H=%d, %d workers",
             ",".join(methods), seeds, setup.steps, setup.batch, setup.islands, cfg.inner.steps_per_round, args.workers)
    reused = reusable_runs(args.reuse, setup)
    reused = {k: v for k, v in reused.items() if k[0] in methods and k[1] in seeds}
    todo = [m for m in methods if any((m, s) not in reused for s in seeds)]
    started = time.monotonic()
    results = run_all(setup, todo, seeds, args.workers, skip=set(reused)) if todo else []
    results += list(reused.values())
    wall = time.monotonic() - started
    summary = summarize(results, methods)
    print(markdown(summary, setup, cfg, seeds))
    print(f"\nwall time {wall:.0f}s ({args.workers} worker processes, 1 torch thread each)")
    if reused:
        print("reused from " + ", ".join(args.reuse) + ": " + ", ".join(f"{m} seed {s}" for m, s in sorted(reused)))
    if args.json:
        payload = {"setup": asdict(setup), "seeds": seeds, "wall_s": wall,
                   "runs": [asdict(r) for r in results], "summary": {k: asdict(v) for k, v in summary.items()}}
        Path(args.json).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
