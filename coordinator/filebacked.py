"""Parameters kept in a file mapped into memory, whose pages are handed back to the kernel after each use.

A lossy downlink's published copy (coordinator/publish.py) is what every island holds: the coordinator writes it
once a round, span by span as it publishes, and reads it whole only when an island joins or resyncs, the run is
evaluated or checkpointed. The rest of the time it need not be resident. Kept in an unlinked file beside the
spool and mapped shared, its pages live in the page cache, not in the process's anonymous memory: each user hands
the pages it touched back (madvise MADV_DONTNEED, which for a shared file mapping keeps the values in the file), so
the coordinator holds theta, momentum and the accumulator resident, not a fourth copy of the model, and under
memory pressure the kernel writes the copy out instead of the process being killed.

The file's blocks are reserved when it is made (posix_fallocate): a disk too small is an error at start, never a
SIGBUS when a page is first written.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping

import torch

PAGE = mmap.PAGESIZE


class FileBackedParams:
    """fp32 tensors shaped as `like`, initialised to its values, in one unlinked file under directory (None: the
    system's temporary directory). `tensors` are ordinary writable tensors on the mapping."""

    def __init__(self, like: Mapping[str, torch.Tensor], directory: str | os.PathLike | None = None):
        self._offsets: dict[str, int] = {}
        size = 0
        for name, t in like.items():
            self._offsets[name] = size
            size += -(-4 * t.numel() // PAGE) * PAGE  # each tensor starts on a page
        self.nbytes = max(size, PAGE)
        with tempfile.TemporaryFile(prefix="published-", dir=directory) as f:
            try:
                os.posix_fallocate(f.fileno(), 0, self.nbytes)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {self.nbytes / 2**20:,.0f} MiB for the published parameters in "
                              f"{directory or tempfile.gettempdir()} ({e.strerror}): free that much disk there, or start the "
                              f"coordinator with TMPDIR on a larger disk (its spool goes there too)") from e
            self._map = mmap.mmap(f.fileno(), self.nbytes)  # shared: the values live in the file; the map keeps it open
        self.tensors: dict[str, torch.Tensor] = {}
        for name, t in like.items():
            if t.numel() == 0:  # frombuffer makes no empty tensor
                self.tensors[name] = torch.empty(t.shape)
                continue
            view = torch.frombuffer(self._map, dtype=torch.float32, count=t.numel(), offset=self._offsets[name])
            self.tensors[name] = view.view(t.shape)
            self.tensors[name].copy_(t.detach())
            self.release(name)

    def release(self, name: str | None = None, lo: int = 0, hi: int | None = None) -> None:
        """Hands back the whole pages of elements [lo, hi) of `name` (every tensor's without a name): their values stay
        in the file and are read back from the page cache at the next use."""
        if name is None:
            self._map.madvise(mmap.MADV_DONTNEED, 0, self.nbytes)
            return
        base = self._offsets[name]
        end = self.tensors[name].numel() if hi is None else hi
        start, stop = -(-(base + 4 * lo) // PAGE) * PAGE, (base + 4 * end) // PAGE * PAGE
        if hi is None:  # the tensor's last page is its own (each starts on a page)
            stop = -(-(base + 4 * end) // PAGE) * PAGE
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)


class HandingBack(Mapping):
    """A read of whole tensors, one after another (an evaluator loading them into its model): each tensor's pages are
    handed back (release(name)) when the next one is read; the reader hands back the last. So a file-backed copy read
    whole is resident a tensor at a time, not whole; a tensor read again later is read back from the file."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], release: Callable[[str], None]):
        self._tensors, self._release = tensors, release
        self._last: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        if self._last is not None and self._last != name:
            self._release(self._last)
        self._last = name
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
