"""Replica groups of one island, kept in step by torchft.

An island runs R replica groups, each an FSDP world of N ranks with the same
layout, so rank k of every group holds the same shard. Every inner step is a
torchft step: a quorum (a restarted group heals here from a live peer over
torchft's HTTP checkpoint transport, rank k from rank k), an all-reduce of the
local gradient shards across the groups, and should_commit before the
optimizer steps. A dead group is left out of the next quorum after the
lighthouse's heartbeat timeout; the others go on.

With one replica group there is nothing to keep in step: Solo stands in with
the same interface and no torchft at all.

What the ranks agree on sits here too, in `ReplicaGroups`: within a group over
its torch.distributed world, across the groups through torchft (the gradients
with the rounds and the round clock riding along, a push's outcome at a
landing, whether every shard holds theta_global at the finish), and who takes
a push over when the pushing group died: the quorum's rank-0 group.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from islands.world import IslandWorld

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
FT_HOST_ENV = "DILOCO_FT_HOST"


@dataclass
class FtConfig:
    """torchft settings; the defaults suit a data centre, tests shorten them."""

    lighthouse: str = ""  # http://HOST:PORT of the island's lighthouse
    host: str = ""  # the address peers reach this group's manager and checkpoint server at
    # Collectives, should_commit, checkpoint transfer. The groups that do not push wait in a
    # collective while one rank pushes its shard: keep this above one shard's push time.
    timeout_s: float = 300.0
    quorum_timeout_s: float = 1800.0  # a quorum may wait for peers that are pulling a round's result
    connect_timeout_s: float = 30.0
    startup_wait_s: float = 60.0  # at start, how long to wait for every group before training without some

    def resolved_host(self) -> str:
        return self.host or os.environ.get(FT_HOST_ENV) or socket.gethostname()


def start_lighthouse(host: str, port: int = 0, heartbeat_timeout_ms: int = 5000, join_timeout_ms: int = 1000):
    """Starts a torchft lighthouse for one island; returns (server, address peers should use).

    The server reports its hostname, not where it listens; the address handed
    to the groups is built from `host` instead.
    """
    from torchft.coordination import LighthouseServer

    loopback = host in ("127.0.0.1", "localhost", "::1")
    bind = f"127.0.0.1:{port}" if loopback else f"[::]:{port}"
    server = LighthouseServer(
        bind=bind, min_replicas=1, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_timeout_ms
    )
    bound = int(re.search(r":(\d+)/?$", server.address()).group(1))
    address = f"http://{host}:{bound}"
    log.info("lighthouse for this island at %s (bound %s)", address, bind)
    return server, address


class Solo:
    """One replica group: every step commits, nothing crosses groups."""

    group = 0
    healed_steps: list[int]

    def __init__(self) -> None:
        self.healed_steps = []

    def start_step(self) -> bool:
        """Starts a step; True if this group was just healed from a peer."""
        return False

    def participating_rank(self) -> int:
        return 0

    def participants(self) -> int:
        return 1

    def allreduce_(self, t: torch.Tensor, op: ReduceOp = ReduceOp.AVG) -> None:
        pass

    def report_error(self, e: Exception) -> None:
        raise e

    def commit(self) -> bool:
        return True

    def step(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


def _http_transport(host: str, timeout: timedelta):
    """torchft's HTTP checkpoint transport, advertising `host` rather than gethostname()."""
    from torchft.checkpointing import HTTPTransport

    class HostHTTPTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return HostHTTPTransport(timeout=timeout, num_chunks=0)


class Replicas:
    """This rank's view of the island's replica groups, through a torchft Manager.

    state_dict / load_state_dict are what a healing peer gets and applies: the
    rank's model shard, inner optimizer state, theta_global shard and position.
    """

    def __init__(
        self,
        cfg: FtConfig,
        group: int,
        rank: int,
        world_size: int,
        device: torch.device,
        replica_id: str,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
    ):
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        if not cfg.lighthouse:
            raise ValueError(
                "an island with several replica groups needs a torchft lighthouse: pass --lighthouse http://HOST:PORT "
                f"or set {LIGHTHOUSE_ENV} (`diloco-island join --replica-groups R` starts one for you)"
            )
        self.group = group
        self.healed_steps: list[int] = []
        self._load = load_state_dict
        timeout = timedelta(seconds=cfg.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        host = cfg.resolved_host()

        def load(state: dict) -> None:
            self.healed_steps.append(-1)  # the step is known only after the quorum; see start_step
            load_state_dict(state)

        def make() -> Manager:
            return Manager(
                pg=pg,
                load_state_dict=load,
                state_dict=state_dict,
                min_replica_size=1,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timedelta(seconds=cfg.connect_timeout_s),
                rank=rank,
                world_size=world_size,
                store_addr=os.environ["MASTER_ADDR"],
                store_port=int(os.environ["MASTER_PORT"]),
                lighthouse_addr=cfg.lighthouse,
                replica_id=replica_id,
                hostname=host,
                checkpoint_transport=_http_transport(host, timeout),
                init_sync=True,
            )

        # Rank 0 publishes its manager's address in the group's store; a store that
        # outlived an earlier attempt (torchrun restarts) still holds the old one, so
        # the others read it only once rank 0 has written the new one.
        self.manager = make() if rank == 0 else None
        dist.barrier()
        if rank != 0:
            self.manager = make()
        log.info("replica group %d rank %d: torchft manager up (lighthouse %s, advertised as %s)", group, rank, cfg.lighthouse, host)

    def start_step(self) -> bool:
        """Quorum for the next step; heals this group from a peer if it is behind. True if it healed."""
        before = len(self.healed_steps)
        self.manager.start_quorum()
        if len(self.healed_steps) > before:
            self.healed_steps[-1] = self.manager.current_step()
            return True
        return False

    def participating_rank(self) -> int:
        rank = self.manager.participating_rank()
        return -1 if rank is None else rank

    def participants(self) -> int:
        return self.manager.num_participants()

    def allreduce_(self, t: torch.Tensor, op: ReduceOp = ReduceOp.AVG) -> None:
        """In place across the groups in the quorum. A failure is recorded: the step will not commit."""
        self.manager.allreduce(t, reduce_op=op).wait()

    def report_error(self, e: Exception) -> None:
        self.manager.report_error(e)

    def commit(self) -> bool:
        """Every rank of the group gets the same answer; False: a peer failed, redo the step."""
        return self.manager.should_commit()

    def step(self) -> int:
        return self.manager.current_step()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


# --- what the ranks agree on -----------------------------------------------------------------------------


@dataclass
class Averaged:
    """An inner step's gradients averaged across the groups, and what rode along with them."""

    committed: bool  # the step commits (the optimizer steps); False: redo it
    loss: float  # the groups' mean loss (this group's own with one group)
    clock: list[float] = field(default_factory=list)  # the groups' mean round clocks (time mode, several groups)
    disagreed: bool = False  # the groups are in different rounds: each resyncs


class ReplicaGroups:
    """This rank's replica groups (Solo until the island starts torchft's: `use`) and what its ranks agree on.

    Every method that agrees runs on every rank of every group at the same step.
    """

    def __init__(self, world: IslandWorld, groups: int = 1, ft: "Solo | Replicas | None" = None):
        self.world, self.groups = world, groups
        self.ft: Solo | Replicas = ft or Solo()

    def use(self, ft: "Replicas") -> None:
        """From now on the groups are torchft's (started as the island began to run)."""
        self.ft = ft

    # the replica groups' own calls, as Solo and Replicas answer them
    def start_step(self) -> bool:
        return self.ft.start_step()

    def participating_rank(self) -> int:
        return self.ft.participating_rank()

    def participants(self) -> int:
        return self.ft.participants()

    def allreduce_(self, t: torch.Tensor, op: ReduceOp = ReduceOp.AVG) -> None:
        self.ft.allreduce_(t, op)

    def commit(self) -> bool:
        return self.ft.commit()

    def step(self) -> int:
        return self.ft.step()

    def shutdown(self) -> None:
        self.ft.shutdown()

    @property
    def healed_steps(self) -> list[int]:
        return self.ft.healed_steps

    def leads(self) -> bool:
        """This group is rank 0 of the step's quorum: it pushes, takes over a push nobody reported, leaves, saves."""
        return self.ft.participating_rank() == 0

    # within the group
    def reduce(self, values: list[float], op=ReduceOp.SUM) -> list[float]:
        """A few numbers reduced over this group's ranks."""
        return self.world.reduce(values, op)

    # across the groups
    def average_gradients(self, model: torch.nn.Module, loss: float, tag: float, clock: list[float]) -> Averaged:
        """Averages the local gradient shards (and the loss) across the groups, then asks whether the step commits.

        tag: the fragments' rounds as one small whole number (below 4093, so its square is exact in fp32); if the
        groups disagree on it, in every group mean(r) != r or mean(r^2) != r^2, nobody commits, and each resyncs.
        clock: this rank's round clocks (time mode): the groups' mean comes back.
        """
        if self.groups == 1:
            return Averaged(self.ft.commit(), loss)
        from islands.fsdp import local_grads

        grads = list(local_grads(model))
        extra = torch.tensor([loss, tag, tag * tag, *clock], dtype=grads[0].dtype, device=grads[0].device)
        expected = extra[1:3].tolist()  # as the collective's dtype holds them
        flat = torch.cat(grads + [extra])
        self.ft.allreduce_(flat)
        loss, mean_r, mean_r2, *clock = flat[-extra.numel():].tolist()
        disagreed = [mean_r, mean_r2] != expected
        if disagreed:
            self.ft.report_error(RuntimeError("replica groups are in different rounds"))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()])
            offset += g.numel()
        return Averaged(self.ft.commit(), loss, clock, disagreed)

    def agree_report(self, report: int) -> int | None:
        """A push's outcome at its landing: the worst report within the group (MAX), summed across the groups (one
        group reports, the others add 0); None when the step did not commit (the landing is redone)."""
        (worst,) = self.world.reduce([report], ReduceOp.MAX)
        flag = torch.tensor([worst], dtype=torch.float32, device=self.world.device)
        self.ft.allreduce_(flag, ReduceOp.SUM)
        if not self.ft.commit():
            return None
        return int(flag.item())

    def agree_all(self, holds: bool, last_try: bool = False) -> bool | None:
        """Whether `holds` on every rank of every group; None when the step did not commit (unless last_try)."""
        (bad,) = self.world.reduce([float(not holds)])
        flag = torch.tensor([float(bad == 0), 1.0], dtype=torch.float32, device=self.world.device)
        self.ft.allreduce_(flag, ReduceOp.SUM)
        if not self.ft.commit() and not last_try:
            return None
        return flag[0].item() == flag[1].item()
