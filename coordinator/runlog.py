"""The coordinator's run log: one JSON line per closed round, and TensorBoard when asked.

JSON lines at an fsspec URL (--log-url: a local folder or s3://bucket/prefix),
one file per process run, `rounds-<start>.jsonl`, rotated by size into
`rounds-<start>-1.jsonl`, ... (diloco/jsonlog.py; read_log reads them in
order), each record written as it comes: first a start record with the run's
config, then one record per RoundSummary with every field of it (timings, traffic, contributions, data account; NaN as null) and
`traffic_factor`, the bytes a data-parallel ring all-reduce would have sent
per byte sent.

TensorBoard (--tensorboard DIR; the optional `tensorboard` package): the run's
config TOML as text, and per round, at step round + 1 (outer steps taken; the
initial eval loss at step 0): loss/eval, loss/train, loss/island/<id>,
tokens, bytes/up, bytes/down, bytes/ddp, traffic_factor, seconds/round and
seconds/<phase> for wait, fold, step, publish, eval. With several fragments
(Streaming DiLoCo) the tags are under fragment<f>/.
"""

from __future__ import annotations

import math
import threading
import time

from diloco.config import RunConfig
from diloco.jsonlog import JsonLines, message_dict, tensorboard_writer
from diloco.v1 import diloco_pb2 as pb

PHASES = ("wait", "fold", "step", "publish", "eval")


def traffic_factor(summary: pb.RoundSummary) -> float:
    """Bytes a data-parallel ring all-reduce would have sent, per byte this round sent (NaN if none)."""
    sent = summary.bytes_up + summary.bytes_down
    return summary.ddp_bytes / sent if sent else math.nan


class RunLog:
    """url: where JSON lines go ("": none); tensorboard_dir: where TensorBoard events go ("": none).

    Raises diloco.jsonlog.LogError (a ValueError) when either cannot be opened, or tensorboard is missing."""

    def __init__(self, url: str, tensorboard_dir: str, cfg: RunConfig, flush_s: float = 5.0):
        self._lock = threading.Lock()
        self.lines = JsonLines(url, "rounds", flush_s) if url else None
        self.board = None
        try:
            if tensorboard_dir:
                self.board = tensorboard_writer(tensorboard_dir, cfg.to_toml(), flush_s=flush_s)
        except BaseException:
            self.close()
            raise
        self._initial = False
        if self.lines is not None:
            self.lines.write({"time": round(time.time(), 3), "event": "start", "config": cfg.to_dict()})

    def record(self, summary: pb.RoundSummary) -> None:
        """One closed round (any thread)."""
        factor = traffic_factor(summary)
        if self.lines is not None:
            self.lines.write({"time": round(time.time(), 3), "event": "round", **message_dict(summary), "traffic_factor": factor})
        with self._lock:
            if self.board is not None:
                self._scalars(summary, factor)

    def _scalars(self, s: pb.RoundSummary, factor: float) -> None:
        prefix = f"fragment{s.fragment}/" if s.fragments > 1 else ""
        step = s.round + 1
        if not self._initial and math.isfinite(s.initial_eval_loss):
            self.board.add_scalar(f"{prefix}loss/eval", s.initial_eval_loss, 0)
            self._initial = True
        scalars = {
            "loss/eval": s.eval_loss, "loss/train": s.train_loss, "tokens": s.tokens, "bytes/up": s.bytes_up,
            "bytes/down": s.bytes_down, "bytes/ddp": s.ddp_bytes, "traffic_factor": factor, "seconds/round": s.seconds,
            **{f"seconds/{p}": getattr(s, f"{p}_s") for p in PHASES},
            **{f"loss/island/{c.island_id}": c.train_loss for c in s.contributions},
            **{f"tasks/{k}": v for k, v in s.task_scores.items()},
        }
        for tag, value in scalars.items():
            if math.isfinite(value):
                self.board.add_scalar(prefix + tag, value, step)

    def flush(self) -> None:
        if self.lines is not None:
            self.lines.flush()
        with self._lock:
            if self.board is not None:
                self.board.flush()

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()
            self.lines = None
        with self._lock:
            if self.board is not None:
                self.board.close()
                self.board = None
