"""The outer side of DiLoCo: token-weighted aggregation and the outer optimizer.

Kept free of networking so the coordinator, the tests and the benchmarks share
exactly the same arithmetic.

Late contributions (rounds.late_rounds > 0) are folded one of two ways (rounds.late_mode):

- "discount": into the round's token-weighted mean, each at weight w = tokens x
  late_discount ** staleness (on time: w = tokens); one Nesterov step on the mean.
- "delayed_nesterov": Liu et al. 2024 (arXiv 2401.09135, Algorithm 3), adapted to
  synchronous rounds. There every push moves the parameters at once by lr x g / N,
  momentum-free, and goes into a buffer; every N pushes the momentum takes the buffer's
  mean and the step adds lr x beta x m (their momentum-activation factor c, which lets
  part of the momentum act between those steps, is 0 here). A stale pseudo-gradient is
  thus never amplified by the momentum it arrives at, yet in the end counts as much as
  a fresh one. Rounds change the parameters only at a close, so taken literally (a
  round as the window; a late contribution arrives in the window of the round it is
  folded into) its direct step and its momentum update fall on the same close: one
  Nesterov step on the round's mean, which is "discount". Keeping DN's separation, the
  on-time contributions are the round's buffer and step as in plain DiLoCo, and a late
  contribution moves the parameters momentum-free at the close that folds it, at its
  share of that round, then joins the momentum one close later. With the same weights w,
  and W_r the round's total weight (so A + B is the "discount" mean):

      A_r = sum_on-time w_i g_i / W_r        B_r = sum_late w_j g_j / W_r   (B = 0 without late ones)
      m_r = (mu m_{r-1} + B_{r-1}) + A_r     (m_0 = A_0)
      theta_r = theta_{r-1} - lr (A_r + mu m_r) - lr B_r    (heavy ball, outer.nesterov false: - lr m_r - lr B_r)

  late_discount ** staleness is the one knob of both modes. Without late contributions
  this is torch's SGD, operation for operation, so bit for bit the default mode. Between
  rounds the state is V_r = mu m_r + B_r (what the next round's momentum starts from), in
  place of torch's momentum buffer, so nothing more is checkpointed; the one extra
  model-sized buffer is the late part's sum (PseudoGradientAccumulator.late_sums,
  allocated at the first late contribution in this mode, then reused).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from diloco.config import OuterConfig


class PseudoGradientAccumulator:
    """Running token-weighted sum of pseudo-gradients in fp32: memory O(model), not O(islands x model).

    Contributions are scaled by tokens / tokens_of_first_contribution rather than
    by raw token counts, so that with equal token counts (the usual case) or a
    single island the sum is formed with scale 1.0 and the mean loses no bits.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]):
        self.shapes = dict(shapes)
        self.sums = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
        # rounds.late_mode = "delayed_nesterov": late contributions summed apart (allocated at the first one).
        self.late_sums: dict[str, torch.Tensor] | None = None
        self.reset()

    def reset(self) -> None:
        for t in self.sums.values():
            t.zero_()
        if self.late_sums is not None:
            for t in self.late_sums.values():
                t.zero_()
        self.reference_tokens: int | None = None
        self.total_tokens = 0
        self.contributions = 0
        self.late_contributions = 0
        self._divided = False

    def scale_for(self, tokens: float) -> float:
        """A contribution's scale; 0 for one trained on no tokens (an island that resynced at its round's
        end pushes a zero pseudo-gradient, which must not dilute the others)."""
        if tokens < 0:
            raise ValueError(f"a contribution needs a token count >= 0, got {tokens}")
        ref = self.reference_tokens or tokens
        return tokens / ref if tokens else 0.0

    def part(self, late: bool = False) -> dict[str, torch.Tensor]:
        """The sums chunks are added to: the on-time part, or the late one (allocated at its first use). Called before
        chunks are added from several threads, so the late part is allocated once."""
        if late and self.late_sums is None:
            self.late_sums = {n: torch.zeros(shape, dtype=torch.float32) for n, shape in self.shapes.items()}
        return self.late_sums if late else self.sums

    def add_chunk(self, name: str, offset: int, values: torch.Tensor, scale: float, late: bool = False) -> None:
        """Adds values x scale at offset; late: into the late part (rounds.late_mode = "delayed_nesterov").
        Chunks at disjoint offsets may be added from several threads at once (after part(late))."""
        flat = self.part(late)[name].view(-1)
        flat[offset : offset + values.numel()].add_(values, alpha=scale)

    def add_encoded(self, name: str, offset: int, numel: int, payload: bytes | memoryview, codec, scale: float,
                    late: bool = False) -> None:
        """add_chunk of codec's decoding of payload (a diloco.wire.codec.Codec); at unit scale decoded and added in one pass
        (codec.decode_add: the same bits as adding the decoded values, without them)."""
        flat = self.part(late)[name].view(-1)[offset : offset + numel]
        if scale == 1.0:
            codec.decode_add(payload, flat)
        else:
            flat.add_(codec.decode_view(payload, numel), alpha=scale)

    def commit(self, tokens: float, late: bool = False) -> None:
        """Counts a contribution whose chunks have all been added with scale_for(tokens). tokens is its weight: a
        token count, or a late contribution's discounted one (a float); late: it went to the late part."""
        if self._divided:
            raise RuntimeError("the accumulator holds a mean; reset() it before adding the next round")
        if self.reference_tokens is None and tokens > 0:
            self.reference_tokens = tokens
        self.total_tokens += tokens
        self.contributions += 1
        self.late_contributions += late

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
        divisor = self._divide()
        if divisor is not None:
            for t in self.sums.values():
                t.div_(divisor)
            for t in (self.late_sums.values() if self.late_contributions else ()):
                t.div_(divisor)
        return self.sums

    def mean_spans(self) -> Callable[[str, int, int], torch.Tensor]:
        """mean() a span at a time: span(name, lo, hi) is elements [lo, hi) of that parameter's flat mean, divided in
        place by whoever asks (each span once, from any thread), so the division runs where the outer step reads the
        span, while it is in cache, instead of in a model-wide pass of its own. The same bits as mean() (elementwise).
        The late part is not divided: use parts() when contributions went apart (delayed Nesterov)."""
        if self.late_contributions:
            raise RuntimeError("late contributions went apart (delayed Nesterov): divide with parts()")
        divisor = self._divide()

        def span(name: str, lo: int, hi: int) -> torch.Tensor:
            t = self.sums[name].view(-1)[lo:hi]
            return t.div_(divisor) if divisor is not None else t

        return span

    def _divide(self) -> float | None:
        """Marks the sums as the mean; returns what to divide them by, or None when they are the mean already (one
        island, equal scale, nobody trained, or divided before)."""
        if not self.contributions:
            raise RuntimeError("no contribution to average")
        if self._divided or not self.total_tokens:  # nobody trained: each contribution was added with scale 0
            self._divided = True
            return None
        self._divided = True
        divisor = self.total_tokens / self.reference_tokens
        return None if divisor == 1.0 else divisor

    def parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(A, B): the on-time and the late contributions each over the round's whole weight, so A + B is
        mean() with every contribution in one sum; B is None when no late contribution went apart."""
        return self.mean(), self.late_sums if self.late_contributions else None


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
        # Delayed Nesterov (step_delayed): V = mu m + B by parameter name, in place of torch's momentum buffer.
        self.carry: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, pseudo_gradient: Mapping[str, torch.Tensor], consume: bool = False) -> None:
        """theta_global <- SGD step with the (mean) pseudo-gradient as the gradient.

        consume: the pseudo-gradient's tensors are the caller's to overwrite (the coordinator's accumulator, reset
        after the step), so Nesterov's look-ahead g + mu m is formed in them instead of in a new model-sized tensor
        each round (its first touch alone cost ~0.15 s of page faults at 125M here). The same operations on the
        same values as torch's single-tensor SGD, so the same bits (tested against torch.optim.SGD).
        """
        if self.carry:
            raise RuntimeError("this outer optimizer steps with delayed Nesterov (rounds.late_mode); use step_delayed")
        if consume and self.steps_by_parameter:
            step = self.span_step()
            for name, p in self.params.items():
                step(name, 0, p.numel(), pseudo_gradient[name].reshape(-1))
            return
        for name, p in self.params.items():
            p.grad = pseudo_gradient[name].reshape(p.shape)
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    @property
    def steps_by_parameter(self) -> bool:
        """Whether span_step applies (Nesterov without weight decay, dampening or maximize, no delayed Nesterov): then
        a step is the same, bit for bit, taken a span of a parameter at a time (the coordinator publishes each span
        as it goes)."""
        group = self.optimizer.param_groups[0]
        return not self.carry and group["nesterov"] and not (group["weight_decay"] or group["dampening"] or group["maximize"])

    @torch.no_grad()
    def span_step(self) -> Callable[[str, int, int, torch.Tensor], None]:
        """step(consume=True) one span at a time (steps_by_parameter must hold): the returned step(name, lo, hi, grad)
        updates elements [lo, hi) of that parameter's flat view with grad, that span of the pseudo-gradient, in
        which it forms Nesterov's look-ahead (overwriting it). Spans of one step may run on several threads at once,
        each exactly once. torch's single-tensor SGD operations, all elementwise, so the same bits as its step."""
        if not self.steps_by_parameter:
            raise RuntimeError("span_step needs Nesterov SGD without weight decay, dampening or delayed Nesterov")
        group = self.optimizer.param_groups[0]
        lr, mu = group["lr"], group["momentum"]
        fresh, buffers = set(), {}
        for name, p in self.params.items():
            state = self.optimizer.state[p]
            if state.get("momentum_buffer") is None:  # torch's first step clones the gradient into the buffer
                state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.contiguous_format)
                fresh.add(name)
            buffers[name] = state["momentum_buffer"].view(-1)

        def step(name: str, lo: int, hi: int, grad: torch.Tensor) -> None:
            buf, p = buffers[name][lo:hi], self.params[name].view(-1)[lo:hi]
            if name in fresh:
                buf.copy_(grad)
            else:
                buf.mul_(mu).add_(grad)
            p.add_(grad.add_(buf, alpha=mu), alpha=-lr)

        return step

    @torch.no_grad()
    def step_delayed(self, on_time: Mapping[str, torch.Tensor], late: Mapping[str, torch.Tensor] | None = None) -> None:
        """The delayed Nesterov step (module docstring): A = on_time drives the momentum now, B = late moves the
        parameters momentum-free now and joins the momentum next round. The operations are torch's SGD ones in
        its order, so with no late part ever the parameters are bit for bit those of step()."""
        group = self.optimizer.param_groups[0]
        lr, mu, nesterov = group["lr"], group["momentum"], group["nesterov"]
        if self.carry is None:  # the first step, or torch's buffer from a checkpoint of a "discount" run: continue it
            self.carry = {}
            for name, p in self.params.items():
                buf = self.optimizer.state[p].pop("momentum_buffer", None)
                if buf is not None and mu:
                    self.carry[name] = buf.mul_(mu)  # what torch's next step would start with
        for name, p in self.params.items():
            a = on_time[name].reshape(p.shape)
            b = late[name].reshape(p.shape) if late is not None else None
            if mu:
                v = self.carry.get(name)
                m = a.detach().clone() if v is None else v.add_(a)  # m_r = (mu m_{r-1} + B_{r-1}) + A_r
                p.add_(a.add(m, alpha=mu) if nesterov else m, alpha=-lr)
            else:
                p.add_(a, alpha=-lr)
            if b is not None:
                p.add_(b, alpha=-lr)  # momentum-free this round
            if mu:
                self.carry[name] = m.mul_(mu) if b is None else m.mul_(mu).add_(b)  # V_r = mu m_r + B_r

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        if self.carry is not None:
            state["carry"] = self.carry
        return state

    def load_state_dict(self, state: dict, delayed: bool = False) -> None:
        """delayed: the run steps with step_delayed (rounds.late_mode = "delayed_nesterov"); a "discount" run's
        state continues exactly in it, not the other way round (V holds the late part and mu m together)."""
        state = dict(state)
        carry = state.pop("carry", None)
        if carry and not delayed:
            raise ValueError("this outer optimizer state was written with rounds.late_mode = 'delayed_nesterov'; "
                             "resume with that setting")
        if carry is not None and set(carry) - set(self.params):
            raise ValueError(f"outer optimizer state for unknown parameters {sorted(set(carry) - set(self.params))[:3]}")
        self.optimizer.load_state_dict(state)
        self.carry = None if carry is None else {n: t.detach().to(self.params[n].device, torch.float32).clone()
                                                  for n, t in carry.items()}


def pseudo_gradient(global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """theta_global - theta_local, in fp32 (from the fp32 master weights)."""
    return {name: g - local_params[name].detach().to(g.device, torch.float32) for name, g in global_params.items()}
