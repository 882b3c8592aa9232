"""One fragment's exchange with the coordinator, in the background while inner steps go on.

At its sync step the island snapshots the fragment's pseudo-gradient
(theta_global_f - theta_local_f, fp32) and hands it to an Exchange: a thread
that pushes it (encoding chunk by chunk on gRPC's sending thread: numba
kernels that release the GIL) and then pulls the round's result straight into
the fragment's theta_global (which the training thread does not touch until
the landing). tau inner steps later the training thread joins the thread;
time spent there counts as waiting for the coordinator, not as compute.
With tau = 0 the exchange runs inline, as plain DiLoCo's blocking exchange.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import torch

from diloco.config import OuterConfig
from diloco.streaming import OuterReplica
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Manifest
from diloco.refusal import Reason
from islands.client import CoordinatorClient, LocalRefusal, MeanBuffer, ReplayableChunks
from islands.outcome import Next, next_step

log = logging.getLogger(__name__)


@dataclass
class EagerState:
    """One fragment's memory for eager updates (see diloco/streaming.py)."""

    replica: OuterReplica
    prev_mean: dict[str, torch.Tensor] | None = None  # the last round's mean pseudo-gradient
    prev_own: dict[str, torch.Tensor] | None = None  # this island's pseudo-gradient of that round
    share: float = 0.0  # this island's token share of that round

    @staticmethod
    def fresh(cfg: OuterConfig) -> "EagerState":
        return EagerState(OuterReplica(cfg))

    def forget(self) -> None:
        """After a resync: no provisional update until a round lands normally again."""
        self.prev_mean = self.prev_own = None


@dataclass
class Exchange:
    fragment: int
    round: int
    pushed_step: int  # inner steps completed at the push
    due: int  # inner steps completed when it lands
    pg: dict[str, torch.Tensor]  # the pushed pseudo-gradient (fp32 snapshot)
    tokens: int = 0  # the push's token weight
    estimate: dict[str, torch.Tensor] | None = None  # eager: the provisional global trained from meanwhile
    mean: MeanBuffer | None = None  # eager: where the round's mean pseudo-gradient arrives
    outcome: pb.ResultHeader | BaseException | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    landed_at: float = 0.0
    inline: bool = False  # ran in the training thread (tau = 0)
    thread: threading.Thread | None = field(default=None, repr=False)

    def run(self, work: Callable[[], pb.ResultHeader], background: bool) -> None:
        """Runs work (push then pull) now, or on a thread of its own; its result or error is the outcome."""

        def target() -> None:
            try:
                with torch.no_grad():
                    self.outcome = work()
            except BaseException as e:  # handed to the training thread at the landing
                self.outcome = e
            self.finished_at = time.monotonic()

        self.started_at = time.monotonic()
        self.inline = not background
        if background:
            self.thread = threading.Thread(target=target, name=f"exchange-f{self.fragment}-r{self.round}", daemon=True)
            self.thread.start()
        else:
            target()

    def wait(self) -> pb.ResultHeader | grpc.RpcError:
        """Blocks until the exchange is over; re-raises anything that is not a gRPC error."""
        if self.thread is not None:
            self.thread.join()
        if isinstance(self.outcome, BaseException) and not isinstance(self.outcome, grpc.RpcError):
            raise self.outcome
        return self.outcome

    def record(self) -> dict:
        return {
            "fragment": self.fragment, "round": self.round, "pushed_step": self.pushed_step, "due": self.due,
            "started_at": self.started_at, "finished_at": self.finished_at, "landed_at": self.landed_at,
        }


def push_and_pull(
    client: CoordinatorClient,
    header: pb.PushHeader,
    chunks: ReplayableChunks,
    targets: dict[str, torch.Tensor],
    manifest: Manifest,
    held: str,
    timeout_s: float,
    mean: MeanBuffer | None = None,
) -> pb.ResultHeader:
    """Pushes the pseudo-gradient, then pulls the round's result into targets.

    Resends the same chunks when the coordinator lost the contribution (a
    restart); any other refusal is raised for the training thread to resync.
    """
    for _ in range(3):
        try:
            client.push(header, chunks)
        except grpc.RpcError as e:
            if next_step(e) is not Next.DELIVERED:  # a retried push whose first try arrived after all
                raise
        while True:
            try:
                return client.pull(
                    header.island_id, header.round, targets, manifest, held, timeout_s, fragment=header.fragment, mean=mean
                )
            except grpc.RpcError as e:
                step = next_step(e)
                if step is Next.WAIT:
                    # The round waits for more islands (below rounds.min_islands): so do we.
                    log.info("%s: %s; waiting on", header.island_id, e.details())
                    continue
                if step is Next.PUSH_AGAIN:
                    log.warning("%s: %s", header.island_id, e.details())
                    break  # resend the same chunks (re-encoding would consume the error feedback again)
                raise
    raise LocalRefusal(Reason.ROUND_CLOSED, "contribution lost repeatedly; resyncing")
