"""The coordinator's log lines that people read at a glance (coordinator/loglines.py)."""

from __future__ import annotations

import pytest

from coordinator.loglines import run_summary_line
from diloco.v1 import diloco_pb2 as pb

pytestmark = pytest.mark.unit


def test_the_run_summary_counts_the_tokens_trained_once_with_streaming_fragments():
    """With Streaming DiLoCo every fragment's rounds cover every inner step: two fragments' summaries hold the same
    tokens twice (the issue-42 team run's line said 589,824 tokens for 294,912 trained)."""
    summaries = [pb.RoundSummary(fragment=f, round=r, tokens=1000 + r, eval_loss=float("nan"))
                 for r in range(3) for f in (0, 1)]
    summaries.append(pb.RoundSummary(fragment=0, round=3, tokens=500, eval_loss=float("nan")))  # a last, short round
    line = run_summary_line(summaries, "abc")
    assert "run finished: 4 rounds" in line and f"{3003 + 500:,} tokens" in line and line.endswith("checksum abc")
    one = [pb.RoundSummary(fragment=0, round=r, tokens=7, eval_loss=float("nan")) for r in range(3)]
    assert "21 tokens" in run_summary_line(one, "x")
