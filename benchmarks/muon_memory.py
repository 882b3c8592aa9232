"""What Muon's whole-matrix step costs a sharded island rank in memory (diloco/models/muon.py), on CPU.

    python -m benchmarks.muon_memory [--config configs/125m.toml] [--vocab 50304] [--ranks 1,2]

For each rank count N it starts N gloo ranks holding the preset's model (FSDP2 over N ranks; N = 1 is
a one-rank island, where torch.optim.Muon steps whole tensors itself), gives every parameter a random
gradient, takes one optimizer step to create the state, then measures the peak resident memory that a
second step adds, for the Muon half (the blocks' matrices) and the AdamW half (embedding, norms) apart.
Every buffer over 64 KiB is its own mapping (MALLOC_MMAP_THRESHOLD_), so each shows in the RSS while it
lives (islands/memwatch.py). Also prints the analytic peak of one matrix's step: the fp32 update
gathered whole (4AB bytes) and Newton-Schulz's bf16 iterate, its next value and two min(A,B)^2 Gram
matrices (4AB + 4 min(A,B)^2), for the largest Muon matrix; matrices are stepped one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diloco.config import load_config
from diloco.inner import build_inner_optimizer
from diloco.models.muon import split_parameters
from islands.fsdp import build_island_model
from islands.memwatch import PeakRss

ROOT = Path(__file__).resolve().parents[1]

MB = 1e6


def _rank(rank: int, world_size: int, config: str, overrides: list[str], workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world_size)
    try:
        cfg = load_config(config, overrides)
        model = build_island_model(cfg.model, torch.device("cpu"), world_size)
        optimizer = build_inner_optimizer(model, cfg.inner)
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=g) * 0.02)
                p.grad = torch.zeros_like(p)
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).copy_(torch.randn(local.shape, generator=g))
        optimizer.step()  # creates the momentum buffers and AdamW's moments
        figures: dict[str, float] = {}
        for name, half in (("muon", optimizer.muon), ("adamw", optimizer.adamw)):
            dist.barrier()
            started = time.monotonic()
            with PeakRss() as meter:
                half.step()
            figures[f"{name}_peak_extra_bytes"] = meter.peak_bytes
            figures[f"{name}_step_s"] = time.monotonic() - started
        local_bytes = sum(4 * (p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        figures["local_param_bytes"] = local_bytes
        Path(workdir, f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def analytic(config: str, overrides: list[str]) -> dict:
    cfg = load_config(config, overrides)
    with torch.device("meta"):
        from diloco.models.llama import Transformer

        model = Transformer(cfg.model)
    shapes = [tuple(p.shape) for p in split_parameters(model)[0]]
    a, b = max(shapes, key=lambda s: s[0] * s[1])
    return {"largest_matrix": [a, b], "matrices": len(shapes), "params": sum(p.numel() for p in model.parameters()),
            "gathered_fp32_bytes": 4 * a * b, "newton_schulz_bf16_bytes": 4 * a * b + 4 * min(a, b) ** 2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/125m.toml"))
    p.add_argument("--vocab", type=int, default=50304, help="model.vocab_size (the preset takes it from its corpus)")
    p.add_argument("--ranks", default="1,2", help="rank counts to measure (default 1,2)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    overrides = [f"model.vocab_size={args.vocab}", "data.source='synthetic'", "data.synthetic_vocab=64",
                 "inner.optimizer='muon'", *args.overrides]
    print(json.dumps({"analytic": analytic(args.config, overrides)}))
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each rank's glibc at start
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for n in (int(r) for r in args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as workdir:
            mp.start_processes(_rank, args=(n, args.config, overrides, workdir), nprocs=n, start_method="spawn")
            ranks = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(n)]
        print(json.dumps({"ranks": n, "per_rank": ranks}))


if __name__ == "__main__":
    main()
