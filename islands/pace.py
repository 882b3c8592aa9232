"""When an island's round ends: the run's fixed schedule, the island's own H, or the round's time.

- The run's schedule (the default): fragment f pushes round r after a fixed
  number of inner steps counted across the run (diloco/fragments.py).
- Its own H (`diloco-island join --steps-per-round N`): every round of this
  island holds N inner steps, whatever the others do (P = 1 only).
- Time-boxed (`rounds.mode = "time"`): the island trains from its round's
  first inner step until `rounds.round_s` seconds of its own wall time have
  passed, at least `inner.min_steps` and at most `inner.max_steps` steps, so a
  fast island does more steps instead of waiting for a slow one. The clock is
  the island's own (no clock is shared with the coordinator); the ranks of a
  sharded island agree on the largest elapsed time, so they stop together.

The lr schedule position of each step and the claim bounds are in diloco/pace.py,
which the coordinator reads too. Pacing is the part of islands/island.py's
Island (a mixin, to keep each file short) that asks these questions.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from diloco.config import RunConfig
from diloco.pace import lr_position, max_round_steps, paced


class PaceError(ValueError):
    """An island setting that cannot work with this run; the message says which."""


class RoundPace:
    def __init__(self, cfg: RunConfig, own_steps: int = 0, groups: int = 1):
        h = cfg.inner.steps_per_round
        if own_steps and cfg.streaming.fragments > 1:
            raise PaceError("--steps-per-round works with streaming.fragments = 1 only (fragment offsets are steps within the run's H)")
        if own_steps < 0 or own_steps > max_round_steps(cfg) - cfg.streaming.overlap:
            raise PaceError(f"--steps-per-round {own_steps} must be in 1..max(inner.steps_per_round, inner.max_steps) = "
                            f"{max_round_steps(cfg) - cfg.streaming.overlap} (the coordinator refuses larger claims)")
        # An island with its own H keeps it in time mode too: it opts out of the clock.
        self.time_boxed = cfg.rounds.mode == "time" and not own_steps
        if self.time_boxed and groups > 1:
            raise PaceError("rounds.mode='time' needs islands of one replica group for now (the groups would have to agree "
                            "on the clock every step); use --steps-per-round, or --replica-groups 1")
        self.custom = paced(cfg, own_steps)  # rounds end by this island's own count or clock
        self.steps = own_steps or h
        self.round_s = cfg.rounds.round_s
        self.min_steps, self.max_steps = cfg.inner.min_steps, cfg.inner.max_steps or h
        self.started = time.monotonic()

    def begin_round(self) -> None:
        """The round's first inner step starts now: the time box counts from here."""
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def due(self, steps: int, elapsed_s: float) -> bool:
        """Whether a round of `steps` inner steps trained over `elapsed_s` seconds ends now (custom paces only)."""
        if not self.time_boxed:
            return steps >= self.steps
        return steps >= self.max_steps or (steps >= self.min_steps and elapsed_s >= self.round_s)


class Pacing:
    """The island's questions about its round's length and lr (methods of islands/island.py's Island)."""

    def _lr_step(self) -> int:
        """The inner lr schedule's position of this step: the run-wide step on the fixed schedule; with a pace of the
        island's own, its step within the round it trains for, placed on that round's positions (diloco/pace.py)."""
        s = self.state
        if not self.pace.custom:
            return s.step
        round_ = s.rounds[0] + (0 in self.inflight)  # during an overlapped exchange it trains for the next round
        return lr_position(round_ * self.cfg.inner.steps_per_round, s.step - s.last_sync[0], self.cfg)

    def _round_over(self, f: int) -> bool:
        """Whether fragment f's round ends at this step: the run's schedule, or this island's own pace (every rank agrees)."""
        s = self.state
        if not self.pace.custom:
            return s.step >= self.layout.round_end(f, s.rounds[f], self.total_rounds)
        elapsed = self.pace.elapsed() if self.pace.time_boxed and s.step > s.last_sync[f] else 0.0
        if self.pace.time_boxed and self.world.world_size > 1:
            (elapsed,) = self.group_reduce([elapsed], dist.ReduceOp.MAX)  # the ranks' clocks differ: stop together
        return self.pace.due(s.step - s.last_sync[f], elapsed)

    def _align_step(self, f: int) -> None:
        """After adopting a round more than one ahead (a resync, a late fold), plain DiLoCo's fixed schedule would make
        the island train several rounds' steps in one: move the step counter (and the round's start with it) to the
        round's start, so the round holds H steps and trains at its own lr."""
        s = self.state
        if self.pace.custom or len(self.fragments) > 1:
            return
        shift = max(0, self.layout.round_start(f, s.rounds[f], self.total_rounds) - s.step)
        s.step += shift
        s.last_sync[f] += shift
