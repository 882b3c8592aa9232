"""Small records the round machines share: refusals, phases, contributions, closed rounds."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import numpy as np

from coordinator.spool import Spool
from diloco.codec import Codec
from diloco.config import RunConfig
from diloco.inner import inner_lr
from diloco.pace import lr_position, max_round_steps, round_first_position
from diloco.refusal import Reason, Refused
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Coverage


__all__ = ["Closed", "Closing", "Contribution", "Phase", "Reason", "Refused", "check_claim", "close_reason", "fold_key",
           "round_summary", "traffic_into"]


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    FINISHED = "finished"


@dataclass
class Contribution:
    """One island's pseudo-gradient for one round, possibly pushed over several streams."""

    tokens: int
    train_loss: float
    coverage: Coverage
    spools: list[Spool] = field(default_factory=list)
    state: str = "pending"  # pending -> folding -> committed
    samples: list[tuple[int, int]] = field(default_factory=list)  # token corpus: the positions trained on
    sumsq: float = 0.0  # of its values, summed as chunks arrive: the norm guard judges it at the close
    sketch: np.ndarray | None = None  # its CountSketch, made as chunks arrive: the guard's direction check
    sketched: bool = True  # every stream of it came with a sketch (a run below three members sketches nothing)
    lr_sum: float = 1.0  # the inner learning rates it was trained with, summed: its norm is judged per unit of it
    origin: int = 0  # the round it was trained for
    codecs: list[Codec] = field(default_factory=list)  # each spool's codec (compression per link: islands' codecs differ)
    # Late contributions (rounds.late_rounds): rounds between origin and the round it is folded into, and
    # the factor on its token weight (rounds.late_discount ** staleness), set when that round closes.
    staleness: int = 0
    discount: float = 1.0

    @property
    def weight(self) -> float | int:
        """Its weight in the token-weighted mean: its tokens, discounted when late (an int when on time, so plain
        rounds keep exactly the arithmetic they had)."""
        return self.tokens if not self.staleness else self.tokens * self.discount


def fold_key(island_id: str, contribution: Contribution) -> str:
    """Names a contribution in a closing round: an island may have an on-time and a late one in the same round."""
    return island_id if not contribution.staleness else f"{island_id} (late from round {contribution.origin})"


@dataclass
class Closing:
    """A round that stopped taking pushes: why, and the contributions to fold, in canonical order."""

    reason: str
    contributions: list[tuple[str, Contribution]]
    waited_s: float = 0.0  # from the round's opening to its close


@dataclass
class Closed:
    """What the driver learns when a round closed."""

    summary: pb.RoundSummary
    total_rounds: int  # rounds closed so far over every fragment (the checkpoint step)
    run_finished: bool


def lr_sum(header: pb.PushHeader, cfg: RunConfig) -> float:
    """The inner learning rates of the steps a push claims, summed (1.0 when that is not positive): a
    pseudo-gradient's norm grows with them (warmup, a fragment's shorter first round), so the norm guard
    compares norm / lr_sum. Where the steps sit on the schedule is the coordinator's to know (the push's
    fragment and round), not the island's word: a first_step claimed at the lr's peak would let an update
    through unclipped at many times an honest norm."""
    total = cfg.rounds.rounds * cfg.inner.steps_per_round
    first = min(max(round_first_position(header.fragment, header.round, cfg), 0), total)
    # The positions the island trained at (diloco/pace.py): a round's extra steps sit at its last position.
    steps = (lr_position(first, j, cfg) for j in range(min(max(1, header.inner_steps), total)))
    s = sum(inner_lr(t, total, cfg.inner) for t in steps)
    return s if s > 0 else 1.0


def check_claim(header: pb.PushHeader, cfg: RunConfig, ranks: int) -> None:
    """Refuses a push claiming more tokens or inner steps than the island's ranks can train in a round."""
    per_step = cfg.inner.batch_size * cfg.data.seq_len
    steps = max_round_steps(cfg)  # time-boxed rounds and islands with their own H: up to inner.max_steps
    if header.inner_steps > steps or header.tokens > header.inner_steps * per_step * ranks or header.tokens % per_step:
        raise Refused(Reason.BAD_REQUEST, f"{header.tokens} tokens in {header.inner_steps} inner steps: not what {ranks} "
                      f"rank(s) train with batch {cfg.inner.batch_size} x seq_len {cfg.data.seq_len} in at most {steps} steps")


def close_reason(done: list[str], live: list[str], dropped: set[str], overdue: bool, min_islands: int,
                 max_islands: int) -> str | None:
    """Why a round may close, from who contributed (done), who is live and dropped, and the deadline; or None."""
    if not done:
        return None
    if len(done) >= max_islands:
        return "max_islands reached"
    if len(done) >= min_islands and all(i in done or i in dropped for i in live):
        return "every live island contributed"
    if overdue and len(done) >= min_islands:
        return "deadline"
    return None


def round_summary(round_: int, fragment: int, contributions: list, numel: int, cfg: RunConfig) -> pb.RoundSummary:
    """What a closing round is made of: its islands (contributions: (island_id, Contribution)), tokens, loss."""
    tokens = sum(c.tokens for _, c in contributions)
    n = len(contributions)
    return pb.RoundSummary(
        round=round_,
        islands=sorted({i for i, _ in contributions}),
        tokens=tokens,
        train_loss=sum(c.train_loss * c.tokens for _, c in contributions) / tokens if tokens else math.nan,
        eval_loss=math.nan,
        # A ring all-reduce of fp32 gradients every inner step over the same islands (this fragment's share).
        ddp_bytes=2.0 * (n - 1) * 4 * numel * cfg.inner.steps_per_round,
        fragment=fragment,
        fragments=cfg.streaming.fragments,
        contributions=[pb.IslandContribution(island_id=i, tokens=c.tokens, train_loss=c.train_loss, staleness=c.staleness,
                                             weight=float(c.weight), codec=c.codecs[0].name if c.codecs else "")
                       for i, c in contributions],
    )


def traffic_into(summary: pb.RoundSummary, traffic: dict[tuple[int, str], list[int]], round_: int) -> dict:
    """Moves round_'s per-island byte counts ((round, island) -> [up, down]) into its summary; returns the rest."""
    for (r, island_id), (up, down) in sorted(traffic.items()):
        if r == round_:
            summary.traffic.add(island_id=island_id, bytes_up=up, bytes_down=down)
            summary.bytes_up += up
            summary.bytes_down += down
    return {k: v for k, v in traffic.items() if k[0] > round_}
