"""Child processes that die with the process that started them, SIGKILL of it included.

Used wherever a launcher starts long-lived children: `diloco-island` its torchruns and their ranks
(islands/launch.py), `diloco-coordinator serve --shards K` its shards (coordinator/launch.py). Why a parent-death
signal in every child rather than a supervisor that kills a process group: torchrun starts each rank in a session
of its own (start_new_session in torch's SubprocessHandler), so killing a group would miss them, and a supervisor is
one more process that can itself be SIGKILLed or OOM-killed. PR_SET_PDEATHSIG is kept by the kernel and fires on any
death of the parent. It follows the thread that forked, not the process: start children from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send sig to this process when its parent dies (Linux only); False if unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def child_dies_with(parent: int):
    """A preexec_fn for subprocess.Popen: the child gets SIGKILL when parent (the caller's pid) dies; if it died
    already, now. Resolved before the fork: a preexec_fn must not import or allocate much."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was set: nobody would send it
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
