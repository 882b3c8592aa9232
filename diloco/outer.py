"""The outer side of DiLoCo: token-weighted aggregation and the outer optimizer.

Kept free of networking so the coordinator, the tests and the benchmarks share
exactly the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from diloco.config import OuterConfig


class PseudoGradientAccumulator:
    """Running token-weighted sum of pseudo-gradients in fp32: memory O(model), not O(islands x model).

    Contributions are scaled by tokens / tokens_of_first_contribution rather than
    by raw token counts, so that with equal token counts (the usual case) or a
    single island the sum is formed with scale 1.0 and the mean loses no bits.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self.sums = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        self.reset()

    def reset(self) -> None:
        for t in self.sums.values():
            t.zero_()
        self.reference_tokens: int | None = None
        self.total_tokens = 0
        self.contributions = 0
        self._divided = False

    def scale_for(self, tokens: float) -> float:
        """A contribution's scale; 0 for one trained on no tokens (an island that resynced at its round's
        end pushes a zero pseudo-gradient, which must not dilute the others)."""
        if tokens < 0:
            raise ValueError(f"a contribution needs a token count >= 0, got {tokens}")
        ref = self.reference_tokens or tokens
        return tokens / ref if tokens else 0.0

    def add_chunk(self, name: str, offset: int, values: torch.Tensor, scale: float) -> None:
        flat = self.sums[name].view(-1)
        flat[offset : offset + values.numel()].add_(values, alpha=scale)

    def commit(self, tokens: float) -> None:
        """Counts a contribution whose chunks have all been added with scale_for(tokens). tokens is its weight: a
        token count, or a late contribution's discounted one (a float)."""
        if self._divided:
            raise RuntimeError("the accumulator holds a mean; reset() it before adding the next round")
        if self.reference_tokens is None and tokens > 0:
            self.reference_tokens = tokens
        self.total_tokens += tokens
        self.contributions += 1

    def add(self, tokens: int, pseudo_gradient: Mapping[str, torch.Tensor]) -> None:
        """Adds a whole contribution at once (in-process use and tests)."""
        scale = self.scale_for(tokens)
        for name, t in pseudo_gradient.items():
            self.add_chunk(name, 0, t.reshape(-1).float(), scale)
        self.commit(tokens)

    def mean(self) -> dict[str, torch.Tensor]:
        """The token-weighted mean, divided in place: the accumulator holds it until reset().

        In place, so a round costs no second model-sized buffer whatever the number
        of islands (the same division, so the same bits, as t / divisor).
        """
        if not self.contributions:
            raise RuntimeError("no contribution to average")
        if not self.total_tokens:  # every contribution trained on nothing: each was added with scale 0
            self._divided = True
            return self.sums
        divisor = self.total_tokens / self.reference_tokens
        if divisor != 1.0 and not self._divided:
            for t in self.sums.values():
                t.div_(divisor)
        self._divided = True
        return self.sums


class OuterOptimizer:
    """SGD with Nesterov momentum over the fp32 global parameters (torch.optim.SGD)."""

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: OuterConfig):
        self.params = dict(params)
        for name, p in self.params.items():
            if p.dtype != torch.float32:
                raise TypeError(f"global parameter {name} must be fp32, got {p.dtype}")
        # torch refuses Nesterov without momentum; momentum 0 is plain SGD (FedAvg at lr 1).
        self.optimizer = torch.optim.SGD(
            list(self.params.values()),
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov and cfg.momentum > 0,
        )

    @torch.no_grad()
    def step(self, pseudo_gradient: Mapping[str, torch.Tensor]) -> None:
        """theta_global <- SGD step with the (mean) pseudo-gradient as the gradient."""
        for name, p in self.params.items():
            p.grad = pseudo_gradient[name].reshape(p.shape)
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def pseudo_gradient(global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """theta_global - theta_local, in fp32 (from the fp32 master weights)."""
    return {name: g - local_params[name].detach().to(g.device, torch.float32) for name, g in global_params.items()}
