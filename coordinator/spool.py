"""Spool files: one push stream's chunks, kept on disk until the contribution is whole.

A pseudo-gradient only reaches the aggregate once every element of it has
arrived, so a stream that breaks off leaves nothing behind. Spooling the
(encoded) chunks to disk keeps coordinator memory at O(model) however many
islands push at once. A record is the chunk's address, its XXH3-64 digest and its
payload as received (no protobuf round trip: the payload is written once and
read once), each checked again as it is read back.
"""

from __future__ import annotations

import os
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from diloco.refusal import Reason, Refused
from diloco.wire import payload_digest

_RECORD = struct.Struct("<QQQHI")  # offset, numel, XXH3-64 of the payload, name bytes, payload bytes


class SpoolCorrupt(OSError):
    """A spool file does not read back what was written (disk or filesystem trouble)."""


@dataclass
class SpooledChunk:
    name: str
    offset: int
    numel: int
    payload: memoryview  # valid until the next chunk is read (Spool.read)


class Spools:
    """Where pushes spool, and the disk they may use there, all islands together (limits.spool_gb)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.used = 0
        self._lock = threading.Lock()

    def open(self, max_numel: int) -> Spool:
        """A spool for one push stream, which may carry at most max_numel elements (its fragment's)."""
        return Spool(self.directory, self, max_numel)

    def reserve(self, n: int) -> None:
        with self._lock:
            if self.used + n > self.max_bytes:
                raise Refused(Reason.SPOOL_FULL, f"the coordinator's spool holds {self.used / 1e9:.2f} GB of pushes, its bound "
                              f"(limits.spool_gb = {self.max_bytes / 1e9:g}): this push was dropped; push again later")
            self.used += n

    def release(self, n: int) -> None:
        with self._lock:
            self.used -= n


class Spool:
    def __init__(self, directory: Path, spools: Spools | None = None, max_numel: int | None = None):
        fd, path = tempfile.mkstemp(prefix="push-", suffix=".spool", dir=directory)
        self.path = Path(path)
        self._file = os.fdopen(fd, "wb")
        self.chunks = self.numel = self.bytes = 0
        self.spools, self.max_numel = spools, max_numel

    def write(self, name: str, offset: int, numel: int, digest: int, payload: bytes) -> None:
        """One chunk whose payload was verified against its digest (diloco.wire.payload_digest) already."""
        encoded = name.encode()
        if self.max_numel is not None and self.numel + numel > self.max_numel:
            # Bounds a stream that repeats chunks: overlaps are only found once the stream ends.
            raise Refused(Reason.BAD_CHUNK, f"the stream carries more than the {self.max_numel} elements its fragment has")
        size = _RECORD.size + len(encoded) + len(payload)
        if self.spools is not None:
            self.spools.reserve(size)
        self.bytes += size
        self.numel += numel
        self._file.write(_RECORD.pack(offset, numel, digest, len(encoded), len(payload)) + encoded)
        self._file.write(payload)
        self.chunks += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def read(self) -> Iterator[SpooledChunk]:
        """The chunks in the order written. Each payload is a view into one reused (writable) buffer: valid until
        the next chunk is read, so the fold decodes it in place instead of allocating and copying per chunk."""
        self.close()
        buffer = bytearray()
        with open(self.path, "rb", buffering=0) as f:
            while header := f.read(_RECORD.size):
                offset, numel, digest, name_len, size = _RECORD.unpack(header)
                name = f.read(name_len).decode()
                if size > len(buffer):
                    buffer = bytearray(size)  # a new one: the previous chunk's view may still be held
                payload = memoryview(buffer)[:size]
                if f.readinto(payload) != size or payload_digest(payload) != digest:
                    raise SpoolCorrupt(f"spool {self.path}: {name}@{offset} does not read back as written")
                yield SpooledChunk(name, offset, numel, payload)

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
        if self.spools is not None:
            self.spools.release(self.bytes)
        self.bytes = 0
