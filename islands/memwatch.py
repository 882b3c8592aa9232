"""How much memory a block of code adds to this process at its peak, across all its threads.

The outer step runs partly on gRPC's threads (they consume the push stream),
so a thread-local tally of torch allocations would miss the encoding. This
measures the process instead: it resets the kernel's resident high-water mark
(VmHWM, via /proc/self/clear_refs) on entry and reads it on exit, so
`peak_bytes` is the most resident memory the block ever added, from torch,
numpy, protobuf and gRPC alike.

Freed heap pages that stay resident could hide a reuse; run with glibc's
MALLOC_MMAP_THRESHOLD_ set (e.g. 65536) so every buffer above that size is a
fresh mapping that shows up in the RSS while it lives. The tests do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_STATUS = "/proc/self/status"


def _status_bytes(key: str) -> int | None:
    try:
        with open(_STATUS) as f:
            m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class PeakRss:
    """with PeakRss() as m: ...; m.mark("push"); ...; then m.peak_bytes and m.phases
    (bytes above the RSS at entry; None where the kernel cannot tell)."""

    base_bytes: int = 0
    peak_bytes: int | None = None

    def __enter__(self) -> "PeakRss":
        self.peak_bytes = None
        self.phases: dict[str, int] = {}
        self._ok = _reset_high_water_mark()
        self.base_bytes = _status_bytes("VmRSS") or 0
        return self

    def mark(self, phase: str) -> None:
        """Ends a phase: records its peak (above the entry RSS) and starts the next from here."""
        hwm = _status_bytes("VmHWM")
        if self._ok and hwm is not None:
            self.phases[phase] = max(self.phases.get(phase, 0), hwm - self.base_bytes)
            _reset_high_water_mark()

    def __exit__(self, *exc) -> None:
        self.mark("rest")
        if self._ok and self.phases:
            self.peak_bytes = max(0, *self.phases.values())
