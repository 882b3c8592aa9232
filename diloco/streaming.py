"""The island-side arithmetic of Streaming DiLoCo: mixing a landed result in, and eager updates.

Mixing (Streaming DiLoCo): when fragment f's round result lands, tau inner
steps after its push,

    theta_local_f <- alpha * theta_local_f + (1 - alpha) * theta_global_f

(alpha = 0 is plain adoption, a copy).

Eager updates (Kale et al., 2025), as this coordinator architecture allows
them. The coordinator runs the outer optimizer and holds the one exact
theta_global, so the island cannot take the outer step itself. Instead, when
it pushes round r of a fragment it builds a provisional estimate of the round's
result and trains from it until the exact result lands:

    g~ = mean_{r-1} + s * (pg_r - pg_{r-1})

the island's own fresh pseudo-gradient plus the others' one-round-stale ones,
weighted as the coordinator weighs them (mean_{r-1}: the round r-1 mean
pseudo-gradient the coordinator sent; pg_{r-1}: the island's own pseudo-
gradient of round r-1; s: the island's token share of round r-1), put through
a replica of the coordinator's outer step (Nesterov SGD; the island advances
its copy of the momentum with every mean it receives):

    theta^ = OuterStep(theta_global_r, momentum replica, g~)
    theta_local_f <- alpha * theta_local_f + (1 - alpha) * theta^        (at the push)
    theta_local_f <- theta_local_f + (1 - alpha) * (theta_global_{r+1} - theta^)   (at landing)

so the local progress of the tau overlapped steps is kept and the estimate is
swapped for the exact global values. With one island and fp32 both ways,
theta^ equals the exact result up to rounding. The coordinator's trajectory
is exactly synchronous DiLoCo either way; only what the island trains on
during the overlap changes.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.config import OuterConfig


@torch.no_grad()
def mix_(local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], alpha: float) -> None:
    """local <- alpha * local + (1 - alpha) * global_, in place; a plain copy when alpha is 0."""
    for name, p in local.items():
        g = global_[name].to(p.device, p.dtype)
        if alpha == 0.0:
            p.copy_(g)
        else:
            p.mul_(alpha).add_(g, alpha=1.0 - alpha)


@torch.no_grad()
def swap_estimate_(
    local: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], estimate: Mapping[str, torch.Tensor], alpha: float
) -> None:
    """local <- local + (1 - alpha) * (exact - estimate): the landed result replaces the eager estimate."""
    for name, p in local.items():
        p.add_((exact[name] - estimate[name]).to(p.device, p.dtype), alpha=1.0 - alpha)


def eager_gradient(
    prev_mean: Mapping[str, torch.Tensor], own_prev: Mapping[str, torch.Tensor], own_fresh: Mapping[str, torch.Tensor], share: float
) -> dict[str, torch.Tensor]:
    """prev_mean + share * (own_fresh - own_prev): own fresh pseudo-gradient, the others' one round stale."""
    return {n: prev_mean[n] + share * (own_fresh[n] - own_prev[n]) for n in own_fresh}


class OuterReplica:
    """The island's copy of the coordinator's outer SGD for one fragment: its momentum, and the step.

    Mirrors torch.optim.SGD's single-tensor arithmetic (dampening 0, no weight
    decay), so fed the coordinator's exact means it holds the coordinator's
    momentum buffer bit for bit.
    """

    def __init__(self, cfg: OuterConfig):
        self.lr, self.momentum = cfg.lr, cfg.momentum
        self.nesterov = cfg.nesterov and cfg.momentum > 0
        self.buffers: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def advance(self, mean: Mapping[str, torch.Tensor]) -> None:
        """The coordinator took its step with this mean pseudo-gradient: move the momentum the same way."""
        if self.momentum == 0:
            return
        if self.buffers is None:
            self.buffers = {n: t.detach().clone() for n, t in mean.items()}
        else:
            for n, buf in self.buffers.items():
                buf.mul_(self.momentum).add_(mean[n])

    @torch.no_grad()
    def step(self, theta: Mapping[str, torch.Tensor], grad: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The parameters the coordinator's next outer step would give for this gradient (nothing is changed)."""
        out = {}
        for n, g in grad.items():
            d = g
            if self.momentum != 0:
                buf = g.clone() if self.buffers is None else self.buffers[n].mul(self.momentum).add_(g)
                d = g.add(buf, alpha=self.momentum) if self.nesterov else buf
            out[n] = theta[n].add(d, alpha=-self.lr)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {} if self.buffers is None else {n: t.clone() for n, t in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self.buffers = {n: t.clone() for n, t in state.items()} if state else None


class EagerState:
    """One fragment's memory for eager updates on an island (its shard of it on a rank of a sharded island)."""

    def __init__(self, cfg: OuterConfig):
        self.replica = OuterReplica(cfg)
        self.prev_mean: dict[str, torch.Tensor] | None = None  # the last round's mean pseudo-gradient
        self.prev_own: dict[str, torch.Tensor] | None = None  # this island's pseudo-gradient of that round
        self.share = 0.0  # this island's token share of that round

    def forget(self) -> None:
        """After a resync: no provisional update until a round lands normally again."""
        self.prev_mean = self.prev_own = None

    def state_dict(self) -> dict:
        return {"momentum": self.replica.state_dict(), "prev_mean": self.prev_mean or {}, "prev_own": self.prev_own or {},
                "share": self.share}

    def load_state_dict(self, state: dict) -> None:
        self.replica.load_state_dict(state["momentum"])
        self.prev_mean, self.prev_own, self.share = state["prev_mean"] or None, state["prev_own"] or None, state["share"]
