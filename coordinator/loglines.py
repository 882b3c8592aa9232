"""What the coordinator's log says of each closed round and of the run at its end: the losses, as torchtitan and the
HF Trainer log them, so that `diloco-coordinator serve` shows whether the run learns without its dashboard."""

from __future__ import annotations

import math
from collections.abc import Sequence

from diloco.progress import human_bytes
from diloco.v1 import diloco_pb2 as pb


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "-"


def round_closed_line(label: str, summary: pb.RoundSummary, reason: str) -> str:
    """`round R closed (why) with N islands: train loss L[, eval loss E]`: train loss is the contributions' mean,
    weighted by their tokens; eval loss where the round was evaluated (eval.every_rounds, and the last)."""
    line = (f"{label}round {summary.round} closed ({reason}) with {len(summary.islands)} islands: "
            f"train loss {_loss(summary.train_loss)}")
    if math.isfinite(summary.eval_loss):
        line += f", eval loss {_loss(summary.eval_loss)}"
    return line


def run_summary_line(summaries: Sequence[pb.RoundSummary], checksum: str) -> str:
    """The run's end: its rounds, eval loss from the initial to the last evaluated one, tokens, traffic against what
    DDP would have sent over the same islands (where known: two islands or more), and the parameters' checksum."""
    rounds = sum(1 for s in summaries if s.fragment == 0)
    # Each fragment's rounds cover every inner step (Streaming DiLoCo syncs all of them, staggered): the tokens trained
    # are one fragment's sum, not all of theirs (two fragments read twice the tokens trained).
    per_fragment: dict[int, int] = {}
    for s in summaries:
        per_fragment[s.fragment] = per_fragment.get(s.fragment, 0) + s.tokens
    tokens = max(per_fragment.values(), default=0)
    evaluated = [s.eval_loss for s in summaries if math.isfinite(s.eval_loss)]
    initial = summaries[-1].initial_eval_loss if summaries else math.nan
    sent = sum(s.bytes_up + s.bytes_down for s in summaries)
    ddp = sum(s.ddp_bytes for s in summaries)
    parts = [f"run finished: {rounds} rounds"]
    if evaluated:
        parts.append(f"eval loss {_loss(initial)} -> {_loss(evaluated[-1])}")
    parts.append(f"{tokens:,} tokens")
    traffic = f"traffic {human_bytes(sent)}"
    if ddp > 0 and sent > 0:
        traffic += f" ({ddp / sent:.0f}x less than DDP's {human_bytes(ddp)})"
    parts += [traffic, f"checksum {checksum}"]
    return ", ".join(parts)
