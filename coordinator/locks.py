"""A readers-writer lock: many readers at once, or one outer step.

Readers hold it only while they take what they send (coordinator/publish.py PublishedValues), never while a
client reads it: a slow or stalled client must not hold up the step that waits for the write lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ReadWriteLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    def acquire_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    @contextmanager
    def read(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    def acquire_write(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer)
            self._writer = True
            self._cond.wait_for(lambda: self._readers == 0)

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()
