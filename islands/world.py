"""The island's local torch.distributed world.

Every island runs inside a process group, even with one rank. Started under
torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment) it joins that world,
which is one replica group of a sharded island; otherwise it makes a one-rank
group of its own. The island's loop (islands/island.py) is the same either way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


def _attempt_store() -> dict:
    """Under a torchrun restart, the store this attempt's ranks meet in, apart from earlier attempts'.

    torch 2.13's elastic agent keeps one TCPStore across restarts while the
    workers assume a fresh one each attempt and add no prefix: a restarted group
    read its dead predecessors' gloo addresses and failed with "Connection
    refused". Namespacing by TORCHELASTIC_RESTART_COUNT avoids that.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(minutes=10)
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"/diloco/attempt_{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


@dataclass
class IslandWorld:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_leader(self) -> bool:
        """Rank 0 talks to the coordinator for the island."""
        return self.rank == 0

    @staticmethod
    def init(device: str = "auto") -> "IslandWorld":
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device == "cuda":
            local, visible = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
            if local >= visible:
                raise ValueError(
                    f"--device cuda: this rank's LOCAL_RANK is {local} but {visible} CUDA device(s) are visible; "
                    "start at most one rank per GPU on a node (--nproc-per-node), or pass --device cpu"
                )
        if not dist.is_initialized():
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend, **_attempt_store())
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        rank = dist.get_rank()
        if device == "cuda":
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        return IslandWorld(rank, dist.get_world_size(), torch.device(device))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def average_gradients(self, model: nn.Module) -> None:
        """Data-parallel gradient mean across the island's ranks (no-op with one rank)."""
        if self.world_size == 1:
            return
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

    def reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        """A few numbers reduced over the group's ranks (in float64 on the group's device); as they are with one rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def broadcast_object(self, obj):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
