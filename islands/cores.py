"""This machine's CPU cores shared by the island ranks that train on it.

torch takes every core by default. Two islands started on one machine (the README's quick start on a
laptop, a test box) then each run as many OpenMP threads as there are cores, and their threads spin
against each other: 20 inner steps took 10.7-14 s where one island alone took 1.3 s. With
`diloco-island join --threads 0` (the default) each rank training on the CPU registers here and takes
its share of the cores it may run on, re-checked at every round, so the ranks started later and
those that ended move the share.

A rank registers by holding a flock on a file of its own in a per-user folder; the kernel drops the
lock however the process ends, so a file nobody holds is a rank that is gone (its file is removed).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import uuid
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _folder() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"diloco-{os.getuid()}")
    folder = Path(runtime) / "diloco-cpu-ranks"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CoreShare:
    """One CPU-training rank's place among those on this machine; apply() sets torch's threads to its share."""

    def __init__(self, folder: Path | None = None, cores: int | None = None):
        self.folder = folder or _folder()
        self.cores = cores or usable_cores()
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = self.folder / f"rank-{name}"
        # Locked before it is visible: another rank counting must never find it unlocked and remove it.
        staged = self.folder / f".staged-{name}"
        self.fd = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.replace(staged, self.path)
        self.threads = 0  # what apply() last set

    def ranks(self) -> int:
        """Ranks training on this machine's CPU now, this one included; removes the files of ranks that are gone."""
        live = 0
        for entry in self.folder.glob("rank-*"):
            if entry == self.path:
                live += 1
                continue
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live += 1  # held: its rank is alive
            else:
                entry.unlink(missing_ok=True)
            finally:
                os.close(fd)
        return max(live, 1)

    def apply(self) -> int:
        """Sets torch's intra-op threads to this rank's share of the cores (call it from the training thread:
        OpenMP's thread count is the calling thread's); returns it."""
        ranks = self.ranks()
        threads = max(1, self.cores // ranks)
        if threads != self.threads:
            torch.set_num_threads(threads)
            log.info("using %d torch thread(s): %d core(s) shared by %d rank(s) training on this machine's CPU "
                     "(--threads N to choose)", threads, self.cores, ranks)
            self.threads = threads
        return threads

    def close(self) -> None:
        if self.fd >= 0:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = -1
