"""What a rank of a sharded island records for tests and debugging (only with --report-dir).

Per rank and attempt (torchrun restarts count up), under the report dir:
`g{group}-r{rank}-a{attempt}.events` (JSON lines as they happen: up, step
with digests of the model, theta_global and optimizer shards after every
quorum, healed, takeover, exchange), `.json` (the summary at exit: position,
memory) and `.pt` (the final model and theta_global shards).

DILOCO_FAULT (entries separated by ";") makes a rank misbehave at a named point,
once, in its first attempt: `die-before-push:group=G,rank=K,round=R[,delay=S]`
SIGKILLs it (tests kill the pushing group exactly mid-push; `die-before-commit`: a
checkpoint's files are written, its marker is not), `hold-before-push:...,delay=S`
makes it push S seconds late, `die-before-land:...,fragment=F` SIGKILLs a pushing rank
at the landing, before it reported its push (an exchange in flight), `perturb-before-pull:...` adds 0.5 to its copy of
theta_global before the pull, as if memory had gone bad. Nothing else reads it: a rank reads
it once, as its `Faults`, which the round and the checkpoint are handed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import torch

FAULT_ENV = "DILOCO_FAULT"


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Faults:
    """One rank's fault-injection points (DILOCO_FAULT), read once, when the rank starts: what the round and the
    checkpoint call at each named point instead of reading the environment there. NO_FAULTS, the default, does
    nothing (unit tests, a library caller)."""

    def __init__(self, group: int = 0, rank: int = 0, spec: str = "", attempt_: int = 0):
        self.group, self.rank = group, rank
        self.entries = [] if attempt_ != 0 else [e.partition(":")[::2] for e in filter(None, spec.split(";"))]

    @classmethod
    def from_env(cls, group: int, rank: int) -> "Faults":
        return cls(group, rank, os.environ.get(FAULT_ENV, ""), attempt())

    def due(self, point: str, round_: int, fragment: int = 0) -> dict[str, str] | None:
        """The arguments of the entry naming this point for this rank, round and fragment (first attempt only)."""
        mine = (self.group, self.rank, round_, fragment)
        for name, args in self.entries:
            want = dict(kv.split("=") for kv in args.split(",") if kv)
            if name == point and tuple(int(want.get(k, v)) for k, v in zip(("group", "rank", "round", "fragment"), mine)) == mine:
                return want
        return None

    def hit(self, point: str, round_: int, fragment: int = 0) -> None:
        """SIGKILLs this process if an entry names this point (a "hold-" point sleeps for its delay instead)."""
        want = self.due(point, round_, fragment)
        if want is None:
            return
        time.sleep(float(want.get("delay", 0)))  # lets the other ranks of the group get their part done first
        if not point.startswith("hold-"):
            os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = Faults()


def digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy())
    return h.hexdigest()


class Evidence:
    def __init__(self, report_dir: str, group: int, rank: int):
        self.enabled = bool(report_dir)
        self.dir = Path(report_dir) if report_dir else None
        self.tag = f"g{group}-r{rank}-a{attempt()}"
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)

    def event(self, name: str, **fields) -> None:
        if self.dir is None:
            return
        with open(self.dir / f"{self.tag}.events", "a") as f:
            f.write(json.dumps({"event": name, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")

    def write(self, summary: dict, tensors: dict) -> None:
        if self.dir is None:
            return
        (self.dir / f"{self.tag}.json").write_text(json.dumps(summary, indent=1))
        torch.save(tensors, self.dir / f"{self.tag}.pt")
