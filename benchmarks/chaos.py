"""Chaos benchmark: the chaos test's scenario with its figures printed.

A 3-island simulation of 12 rounds in which a random island is SIGKILLed and
restarted with --resume after every third round, and the coordinator once after
round 4; then the same run undisturbed. Prints the rounds, the kills, how long
until all islands were back in a round, the end-of-run summary, and the final
eval loss against the undisturbed run (the issue's bound: within 5%).

    python -m benchmarks.chaos
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from islands.sim.chaos import ChaosPlan, describe, run_chaos
from diloco.config import load_config
from islands.sim.simulation import run_sim, summarize

# The chaos test's configuration (tests/test_durability.py): a tiny model, short rounds, checkpoints every round.
OVERRIDES = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32",
    "data.seq_len=32", "inner.batch_size=4", "inner.steps_per_round=80", "inner.lr=1e-2", "inner.warmup_steps=2",
    "eval.batches=4", "rounds.deadline_s=30", "wire.chunk_bytes=4096", "checkpoint.every_rounds=1",
    "rounds.heartbeat_s=0.5", "rounds.lease_s=8",
]


def main() -> None:
    p = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--islands", type=int, default=3)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--seed", type=int, default=1, help="picks which islands die and when")
    args = p.parse_args()
    if args.islands < 1 or args.rounds < 6:
        p.error("needs at least 1 island and 6 rounds")
    cfg = load_config(None, [*OVERRIDES, f"rounds.rounds={args.rounds}", f"rounds.min_islands={args.islands}",
                             f"data.shards={args.islands}"])
    with tempfile.TemporaryDirectory(prefix="diloco-chaos-") as work:
        calm = run_sim(cfg, args.islands, Path(work) / "calm", timeout_s=600, echo=lambda s: None)
        result, chaos = run_chaos(cfg, args.islands, Path(work) / "chaos",
                                  ChaosPlan(island_every=3, coordinator_at=4, seed=args.seed), timeout_s=900)
        print(describe(chaos))
        summarize(result, cfg)
    final, calm_final = result.report["rounds"][-1]["eval_loss"], calm.report["rounds"][-1]["eval_loss"]
    print(f"final eval loss {final:.4f} against {calm_final:.4f} undisturbed ({100 * (final - calm_final) / calm_final:+.2f}%); "
          f"undisturbed run {calm.seconds:.1f}s, chaos run {result.seconds:.1f}s")


if __name__ == "__main__":
    main()
