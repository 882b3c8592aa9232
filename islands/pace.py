"""When an island's round ends: the run's fixed schedule, the island's own H, or the round's time.

- The run's schedule (the default): fragment f pushes round r after a fixed
  number of inner steps counted across the run (diloco/fragments.py).
- Its own H (`diloco-island join --steps-per-round N`): every round of this
  island holds N inner steps, whatever the others do (P = 1 only).
- Time-boxed (`rounds.mode = "time"`): the island trains from its round's
  first inner step until `rounds.round_s` seconds of its own wall time have
  passed, at least `inner.min_steps` and at most `inner.max_steps` steps, so a
  fast island does more steps instead of waiting for a slow one. The clock is
  the island's own (no clock is shared with the coordinator), less the time
  blocked on a round's result; the ranks of a sharded island agree on the
  largest elapsed time, and replica groups on the mean their gradient
  all-reduce carries, so every rank of every group ends the round at the same
  step. With streaming fragments each fragment has its own clock.

The lr schedule position of each step and the claim bounds are in diloco/pace.py,
which the coordinator reads too. Pacing is the part of islands/island.py's
Island (a mixin, to keep each file short) that asks these questions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from diloco.config import RunConfig
from diloco.pace import lr_position, max_round_steps, paced

log = logging.getLogger(__name__)


class PaceError(ValueError):
    """An island setting that cannot work with this run; the message says which."""


class RoundPace:
    """When this island's rounds end; in time mode, one clock per fragment.

    A fragment's time box counts the island's own time from the round's first
    inner step, less the time spent blocked on a round's result (`blocked()`:
    seconds so far): with an overlapped exchange (streaming.tau > 0) the landing
    falls inside the next round, and a box that counted the wait would shrink
    the round to its minimum behind every slow close. With P fragments, a
    fragment's first round here is (H - o_f) / H of round_s, as its first round
    is H - o_f steps on the fixed schedule, so the syncs stay spread.
    """

    def __init__(self, cfg: RunConfig, own_steps: int = 0, blocked: Callable[[], float] = lambda: 0.0,
                 clock: Callable[[], float] = time.monotonic):
        h, p = cfg.inner.steps_per_round, cfg.streaming.fragments
        if own_steps and p > 1:
            raise PaceError("--steps-per-round works with streaming.fragments = 1 only (fragment offsets are steps within the run's H)")
        if own_steps < 0 or own_steps > max_round_steps(cfg) - cfg.streaming.overlap:
            raise PaceError(f"--steps-per-round {own_steps} must be in 1..max(inner.steps_per_round, inner.max_steps) = "
                            f"{max_round_steps(cfg) - cfg.streaming.overlap} (the coordinator refuses larger claims)")
        # An island with its own H keeps it in time mode too: it opts out of the clock.
        self.time_boxed = cfg.rounds.mode == "time" and not own_steps
        self.custom = paced(cfg, own_steps)  # rounds end by this island's own count or clock
        self.steps = own_steps or h
        self.round_s = cfg.rounds.round_s
        self.first_s = [cfg.rounds.round_s * (h - f * h // p) / h for f in range(p)]  # o_f = f * H // P (diloco/fragments.py)
        self.first = [True] * p
        self.min_steps, self.max_steps = cfg.inner.min_steps, cfg.inner.max_steps or h
        self.blocked, self.clock = blocked, clock
        self.started = [clock()] * p
        self.blocked_at_start = [0.0] * p

    def begin_round(self, f: int = 0) -> None:
        """Fragment f's round's first inner step starts now: its time box counts from here."""
        self.started[f], self.blocked_at_start[f] = self.clock(), self.blocked()

    def synced(self, f: int) -> None:
        self.first[f] = False

    def elapsed(self, f: int = 0) -> float:
        """Seconds of fragment f's round so far, less those blocked on a result."""
        return self.clock() - self.started[f] - (self.blocked() - self.blocked_at_start[f])

    def due(self, steps: int, elapsed_s: float, f: int = 0) -> bool:
        """Whether fragment f's round of `steps` inner steps over `elapsed_s` seconds ends now (custom paces only)."""
        if not self.time_boxed:
            return steps >= self.steps
        box = self.first_s[f] if self.first[f] else self.round_s
        return steps >= self.max_steps or (steps >= self.min_steps and elapsed_s >= box)

    def state_dict(self) -> dict:
        """What a healing replica group adopts: the fragments' elapsed times and which first rounds are done."""
        return {"elapsed": [self.elapsed(f) for f in range(len(self.first))], "first": list(self.first)}

    def load_state_dict(self, state: dict) -> None:
        now, blocked = self.clock(), self.blocked()
        self.started = [now - e for e in state["elapsed"]]
        self.blocked_at_start = [blocked] * len(self.started)
        self.first = list(state["first"])


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
        if self.pace.time_boxed and len(self.fragments) > 1 and f != self._turn():
            return False
        elapsed = self._clock()[f] if self.pace.time_boxed and s.step > s.last_sync[f] else 0.0
        return self.pace.due(s.step - s.last_sync[f], elapsed, f)

    def _turn(self) -> int:
        """The fragment whose sync comes next. Time-boxed, islands of different speeds must still push fragments in one
        order, the fixed schedule's: by round, and within a round from fragment P - 1 (the largest offset) down to 0.
        Otherwise island A could wait on fragment 0's round while owing fragment 1's, which B waits on while owing
        fragment 0's: a deadlock until the deadline (torchft's streaming saw the same fragment-order deadlock)."""
        s, p = self.state, len(self.fragments)
        pending = [f for f in range(p) if s.rounds[f] < s.stop_round]
        return min(pending, key=lambda f: (s.rounds[f] + (f in self.inflight), p - 1 - f), default=0)

    def _clock(self) -> list[float]:
        """The fragments' elapsed round times as every rank of every replica group sees them at this step.

        One rank: its own clock. One group of several ranks: the largest of their clocks, reduced once a step.
        Several groups: what the last committed step's gradient all-reduce carried (`_clock_extra`), the same
        bits in every group, so all of them end a round at the same step."""
        s = self.state
        step, agreed = self.agreed_clock
        if step == s.step and (self.spec.groups > 1 or self.world.world_size > 1):
            return agreed
        values = [self.pace.elapsed(f) for f in range(len(self.fragments))]
        if self.spec.groups == 1 and self.world.world_size == 1:
            return values
        if self.spec.groups > 1:
            log.warning("group %d: no agreed round clock at step %d; counting the round from now", self.spec.group, s.step)
            values = [0.0] * len(values)
        elif self.world.world_size > 1:
            values = self.group_reduce(values, dist.ReduceOp.MAX)  # the ranks' clocks differ: stop together
        self.agreed_clock = (s.step, values)
        return values

    def _clock_extra(self) -> list[float]:
        """This rank's fragment clocks, to ride along the replica groups' gradient all-reduce (time mode, several groups)."""
        if not (self.pace.time_boxed and self.spec.groups > 1):
            return []
        return [self.pace.elapsed(f) for f in range(len(self.fragments))]

    def _agree_clock(self, averaged: list[float]) -> None:
        """After a committed step: the groups' mean clocks (rank by rank), the largest over the group's ranks, is the
        clock of the next boundary everywhere."""
        if averaged:
            if self.world.world_size > 1:
                averaged = self.group_reduce(averaged, dist.ReduceOp.MAX)
            self.agreed_clock = (self.state.step + 1, averaged)  # the step about to complete

    def _align_step(self, f: int) -> None:
        """After adopting a round more than one ahead (a resync, a late fold), plain DiLoCo's fixed schedule would make
        the island train several rounds' steps in one: move the step counter (and the round's start with it) to the
        round's start, so the round holds H steps and trains at its own lr. After adopting a round whose end it has
        already passed (its push for that round was not taken: leases the restarted coordinator does not know, a
        checksum that diverged), it trains the round again instead of pushing an empty contribution to it."""
        s = self.state
        if self.pace.custom or len(self.fragments) > 1:
            return
        start = self.layout.round_start(f, s.rounds[f], self.total_rounds)
        redo = s.rounds[f] < s.stop_round and s.step >= self.layout.round_end(f, s.rounds[f], self.total_rounds) > start
        shift = start - s.step if redo else max(0, start - s.step)
        s.step += shift
        s.last_sync[f] += shift
