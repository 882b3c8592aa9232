"""Spool files: one push stream's chunks, kept on disk until the contribution is whole.

A pseudo-gradient only reaches the aggregate once every element of it has
arrived, so a stream that breaks off leaves nothing behind. Spooling the
(encoded) chunks to disk keeps coordinator memory at O(model) however many
islands push at once. A record is the chunk's address, its CRC-32 and its
payload as received (no protobuf round trip: the payload is written once and
read once).
"""

from __future__ import annotations

import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_RECORD = struct.Struct("<QQIHI")  # offset, numel, crc32, name bytes, payload bytes


class SpoolCorrupt(OSError):
    """A spool file does not read back what was written (disk or filesystem trouble)."""


@dataclass
class SpooledChunk:
    name: str
    offset: int
    numel: int
    payload: bytes


class Spool:
    def __init__(self, directory: Path):
        fd, path = tempfile.mkstemp(prefix="push-", suffix=".spool", dir=directory)
        self.path = Path(path)
        self._file = os.fdopen(fd, "wb")
        self.chunks = 0

    def write(self, name: str, offset: int, numel: int, crc32: int, payload: bytes) -> None:
        """One chunk whose payload was verified against crc32 already."""
        encoded = name.encode()
        self._file.write(_RECORD.pack(offset, numel, crc32, len(encoded), len(payload)) + encoded)
        self._file.write(payload)
        self.chunks += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def read(self) -> Iterator[SpooledChunk]:
        self.close()
        with open(self.path, "rb", buffering=0) as f:
            while header := f.read(_RECORD.size):
                offset, numel, crc32, name_len, size = _RECORD.unpack(header)
                name = f.read(name_len).decode()
                payload = f.read(size)
                if len(payload) != size or zlib.crc32(payload) != crc32:
                    raise SpoolCorrupt(f"spool {self.path}: {name}@{offset} does not read back as written")
                yield SpooledChunk(name, offset, numel, payload)

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
