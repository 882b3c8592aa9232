"""Error feedback: what a lossy codec failed to send, owed by the sender (one implementation, every island)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from diloco.wire.codec import Codec


@torch.no_grad()
def subtract_residual_(local: Mapping[str, torch.Tensor], residuals: Mapping[str, torch.Tensor], scale: float) -> None:
    """local[name] -= scale * residuals[name], in place; local may be a subset of the names (a fragment
    or a shard's views) and may live on another device."""
    for name, p in local.items():
        p.sub_((residuals[name].view(p.shape) * scale).to(p.device, p.dtype))


class ErrorFeedback:
    """What a lossy codec failed to send, kept by the sender and added to the next round's message.

    Per element: e <- decay * e + x; send C(e); e <- e - D(C(e)). With decay 1
    this is classic error feedback (nothing is ever lost, only delayed);
    SparseLoCo decays it a little.

    in_model (CSER's "error reset"): the residual is not added to the next
    message; the island starts its next round from theta_global - decay * e
    instead, so the unsent part stays in its local parameters, keeps training
    there, and is measured again as part of the next pseudo-gradient. Classic
    error feedback instead re-measures the same displacement from a global point
    that did not move and sums the re-measurements, noise included.

    Buffers are flat per name and may hold a whole parameter or one rank's
    shard of it (offsets count within the buffer). encode() never consumes
    state: it writes the new residual to `pending`, which becomes the state
    (`buffers`) at commit(), once the contribution was delivered; so a push
    that is resent, or taken over by another replica group, encodes the same
    bytes. compress() is encode and commit in one (in-process use).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...] | int], decay: float = 1.0, in_model: bool = False):
        def numel(s) -> int:
            return int(s) if isinstance(s, int) else (int(np.prod(s)) if s else 1)

        self.buffers = {n: torch.zeros(numel(s), dtype=torch.float32) for n, s in shapes.items()}
        self.pending = {n: torch.zeros_like(t) for n, t in self.buffers.items()}
        self.decay = decay
        self.in_model = in_model

    def encode(self, name: str, offset: int, piece: torch.Tensor, codec: Codec) -> bytes:
        """The payload for elements [offset, offset + n) of name; their new residual goes to pending."""
        piece = piece.detach().to("cpu", torch.float32).reshape(-1)
        owed = self.buffers[name][offset : offset + piece.numel()]
        residual = piece.clone() if self.in_model else (owed * self.decay if self.decay != 1.0 else owed.clone()).add_(piece)
        payload = codec.encode(residual)
        self.pending[name][offset : offset + piece.numel()].copy_(residual.sub_(codec.decode(payload, residual.numel())))
        return payload

    def compress(self, name: str, offset: int, piece: torch.Tensor, codec: Codec) -> bytes:
        payload = self.encode(name, offset, piece, codec)
        n = piece.numel()
        self.buffers[name][offset : offset + n].copy_(self.pending[name][offset : offset + n])
        return payload

    def commit(self, names=None) -> None:
        """The encoded contribution was delivered: what it failed to send is now owed (of names, or all)."""
        for name in names if names is not None else self.buffers:
            self.buffers[name].copy_(self.pending[name])

    def reset(self) -> None:
        for t in self.buffers.values():
            t.zero_()

    def keep_residual_(self, local: Mapping[str, torch.Tensor], weight: float = 1.0) -> None:
        """local -= weight * decay * residual (in_model, after local was set from theta_global)."""
        subtract_residual_(local, self.buffers, weight * self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.buffers.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        for name, t in state.items():
            if name not in self.buffers or self.buffers[name].shape != t.shape:
                raise ValueError(f"error-feedback state for {name} does not fit this model")
            self.buffers[name].copy_(t)
