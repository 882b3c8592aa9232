"""Progress on long work, one line on stderr rewritten in place: amount, rate, ETA.

Shown only when stderr is a terminal (and the caller does not turn it off, e.g.
on ranks other than an island's first); silent otherwise, so logs and pipes get
no carriage returns. `force=True` shows it anyway (tests). A silent Progress
costs an addition per update.

    with Progress("fetching parameters", total=n_bytes) as p:
        for chunk in stream:
            p.update(len(chunk))

Work with no natural callbacks (a torch.distributed.checkpoint save) can show
its elapsed time with `ticking()`, a thread redrawing the line until the block ends.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# Transfers smaller than this take about a second or less: not worth a progress line among the logs.
WORTH_SHOWING = 64 << 20


def human_bytes(n: float) -> str:
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {_UNITS[-1]}"


def human_seconds(s: float) -> str:
    s = max(0, int(round(s)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def shows_progress(stream: TextIO | None = None) -> bool:
    """Whether a Progress on stream (default stderr) would print: it is a terminal."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


class Progress:
    """Progress of one piece of work: unit "B" counts bytes (shown in KiB, MiB...), any other unit items."""

    def __init__(self, label: str, total: float | None = None, unit: str = "B", *, enabled: bool = True,
                 force: bool = False, stream: TextIO | None = None, interval_s: float = 0.2, initial: float = 0):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.shown = force or (enabled and shows_progress(self.stream))
        self.interval_s = interval_s
        self.done = self.initial = initial
        self.note = ""
        self.started = self._drawn_at = time.monotonic()
        self._width = 0
        self._closed = False
        self._lock = threading.Lock()

    # --- what the work reports -------------------------------------------------------------

    def update(self, n: float = 1, note: str | None = None) -> None:
        """n more done; note (e.g. "1,024 documents") is shown before the amount from now on."""
        self.done += n
        if note is not None:
            self.note = note
        if self.shown:
            now = time.monotonic()
            if now - self._drawn_at >= self.interval_s:
                self._draw(now)

    def set(self, done: float, note: str | None = None) -> None:
        self.update(done - self.done, note)

    def close(self, message: str | None = None) -> None:
        """Ends the line: message, or the amount, time taken and mean rate."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.shown:
            return
        elapsed = time.monotonic() - self.started
        text = message or f"{self._amount(False)}, done in {elapsed:.1f}s{self._rate(elapsed, ' (', ')')}"
        self._write(f"{self.label}: {text}", end="\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.close(None if kind is None else f"{self._amount(False)}, stopped ({kind.__name__})")

    @contextmanager
    def ticking(self, every_s: float = 0.5) -> Iterator[Progress]:
        """Redraws every every_s seconds until the block ends (elapsed time for work that reports nothing)."""
        if not self.shown:
            yield self
            return
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(every_s):
                self._draw(time.monotonic())

        thread = threading.Thread(target=tick, name="progress", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    # --- drawing ---------------------------------------------------------------------------------

    def _fmt(self, n: float) -> str:
        return human_bytes(n) if self.unit == "B" else f"{n:,.0f} {self.unit}"

    def _amount(self, partial: bool = True) -> str:
        text = f"{self.note}, " if self.note else ""
        text += self._fmt(self.done)
        if partial and self.total:
            text += f" of {self._fmt(self.total)} ({100 * self.done / self.total:.0f}%)"
        return text

    def _rate(self, elapsed: float, before: str = ", ", after: str = "") -> str:
        if elapsed <= 0 or self.done == self.initial:
            return ""
        rate = (self.done - self.initial) / elapsed
        return f"{before}{human_bytes(rate) if self.unit == 'B' else f'{rate:,.0f} {self.unit}'}/s{after}"

    def _draw(self, now: float) -> None:
        self._drawn_at = now
        elapsed = now - self.started
        text = f"{self.label}: {self._amount()}{self._rate(elapsed)}"
        if self.total and self.done > self.initial and self.done < self.total:
            eta = (self.total - self.done) * elapsed / (self.done - self.initial)
            text += f", {human_seconds(eta)} left"
        elif not self.done:  # nothing counted (yet): how long it has been
            text = f"{self.label}: {self.note + ', ' if self.note else ''}{human_seconds(elapsed)}"
        self._write(text, end="")

    def _write(self, text: str, end: str) -> None:
        with self._lock:
            pad = " " * max(0, self._width - len(text))
            self._width = 0 if end else len(text)
            try:
                print(f"\r{text}{pad}", end=end, file=self.stream, flush=True)
            except (OSError, ValueError):  # a closed terminal must not stop the work
                self.shown = False
