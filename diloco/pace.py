"""How many inner steps an island's round holds, and where each sits on the inner lr schedule.

Islands differ (GPU generations, counts): with `rounds.mode = "time"` each one
trains for `rounds.round_s` seconds a round, between `inner.min_steps` and
`inner.max_steps` inner steps; with `--steps-per-round` one island trains its
own fixed H. The coordinator weights every contribution by its tokens, so
unequal contributions fold as they should; this module holds the rules both
sides must agree on.

The lr schedule. It spans R x H positions (H = inner.steps_per_round, the
nominal H in time mode), and round r owns positions r*H .. r*H + H - 1. An
island's j-th inner step of round r trains at position r*H + min(j, H - 1):
whatever its speed, every island is at the same point of the schedule in the
same round (warmup and decay follow the run's rounds, which is what the outer
step sees), a slow island skips its round's later positions and a fast one
stays at the round's last position for its extra steps. With every island
at H steps (the default) this is exactly the run-wide inner step of plain
DiLoCo. With Streaming DiLoCo (P > 1) on the fixed schedule steps are not
capped (fragments' rounds are offset within H: the run-wide step is the
position); time-boxed, the island's lr follows fragment 0's rounds.
"""

from __future__ import annotations

from diloco.config import RunConfig


def max_round_steps(cfg: RunConfig) -> int:
    """The most inner steps one round of one island may hold (a push claiming more is refused).

    On the fixed schedule with P fragments a fragment's last round holds H + o_f steps, and an island that joins
    or resumes mid-run starts every fragment at the earliest of their round starts, up to o_(P-1) steps before
    the fragment's own (diloco/fragments.py): H + o_(P-1) at most. Time-boxed, or with an island's own H, a
    round holds at most inner.max_steps.
    """
    h, p = cfg.inner.steps_per_round, cfg.streaming.fragments
    return max(h + (p - 1) * h // p, cfg.inner.max_steps) + cfg.streaming.overlap


def round_first_position(fragment: int, round_: int, cfg: RunConfig) -> int:
    """The schedule position of fragment `fragment`'s round `round_` first inner step, as the coordinator knows it:
    on the fixed schedule with fragments, the fragment's round start (diloco/fragments.py: r*H - o_f after round 0);
    otherwise r*H, where an island with a pace of its own also starts it."""
    h, p = cfg.inner.steps_per_round, cfg.streaming.fragments
    if p > 1 and cfg.rounds.mode != "time" and round_ > 0:
        return round_ * h - fragment * h // p
    return round_ * h


def lr_position(round_first: int, j: int, cfg: RunConfig) -> int:
    """The schedule position of an island's j-th inner step (from 0) of a round starting at round_first."""
    if cfg.streaming.fragments > 1 and cfg.rounds.mode != "time":
        return round_first + j
    return round_first + min(j, cfg.inner.steps_per_round - 1)


def paced(cfg: RunConfig, own_steps: int = 0) -> bool:
    """Whether an island's rounds end by its own count or clock rather than the run's fixed H schedule."""
    return cfg.rounds.mode == "time" or (own_steps > 0 and own_steps != cfg.inner.steps_per_round)
