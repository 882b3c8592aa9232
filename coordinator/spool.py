"""Spool files: one push stream's chunks, kept on disk until the contribution is whole.

A pseudo-gradient only reaches the aggregate once every element of it has
arrived, so a stream that breaks off leaves nothing behind. Spooling the
(encoded) chunks to disk keeps coordinator memory at O(model) however many
islands push at once.
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

from diloco.v1 import diloco_pb2 as pb

_LEN = struct.Struct("<Q")


class Spool:
    def __init__(self, directory: Path):
        fd, path = tempfile.mkstemp(prefix="push-", suffix=".spool", dir=directory)
        self.path = Path(path)
        self._file = os.fdopen(fd, "wb")
        self.chunks = 0

    def write(self, chunk: pb.TensorChunk) -> None:
        data = chunk.SerializeToString()
        self._file.write(_LEN.pack(len(data)))
        self._file.write(data)
        self.chunks += 1

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def read(self) -> Iterator[pb.TensorChunk]:
        self.close()
        with open(self.path, "rb") as f:
            while header := f.read(_LEN.size):
                (size,) = _LEN.unpack(header)
                yield pb.TensorChunk.FromString(f.read(size))

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
