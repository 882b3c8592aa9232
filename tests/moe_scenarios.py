"""Multi-process runs of mixture-of-experts islands, for tests/test_moe.py (the machinery is tests/fsdp_scenarios.py's).

    python tests/moe_scenarios.py SCENARIO WORKDIR
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

# The checkout this file is in first, as tests/fsdp_scenarios.py does (not whatever copy is installed).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from conftest import tiny_config  # noqa: E402
from fsdp_scenarios import SHARDED_FLAGS, Run  # noqa: E402


def sharded_and_single(workdir: Path) -> None:
    """A 2 replica groups x 2 FSDP ranks island and a one-rank island training one MoE model, int8 both ways.

    Capacity overflows (factor 0.5), so experts see empty slots; torchft all-reduces every gradient
    shard across the two groups at every step."""
    cfg = tiny_config(
        "model.n_layers=2", "model.d_ff=37", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_capacity_factor=0.5",
        "inner.steps_per_round=3", "rounds.rounds=3", "rounds.min_islands=2", "data.shards=2", "wire.codec='int8'",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
    )
    run = Run(workdir, cfg, deadline_s=200)
    try:
        run.island("sharded", "--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "0",
                   "--report-dir", str(workdir / "sharded"), *SHARDED_FLAGS)
        run.island("single", "--device", "cpu", "--threads", "1")
        run.finish()
    finally:
        run.close()


SCENARIOS = {"sharded_and_single": sharded_and_single}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [scenario] %(levelname)s %(name)s: %(message)s")
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
