"""Spools: one push stream's chunks, kept until the contribution is whole and its round closes.

A pseudo-gradient only reaches the aggregate once every element of it has
arrived, so a stream that breaks off leaves nothing behind. A record is the
chunk's address, its XXH3-64 digest and its payload as received (no protobuf
round trip: the payload is written once and read once).

Records go first into blocks of memory from a pool all spools share
(limits.spool_memory_models), then, once the pool is spent, into the spool's file
on disk. The pool's blocks are kept once allocated and handed from spool to
spool, so a round's pushes cost one copy into memory that is already mapped,
and the fold reads them in place; a write to the page cache and a read back
cost three times as much (125M fp32: 0.13 + 0.05 s against 0.05 s). Memory is
bounded by the pool whatever the number of islands; what does not fit waits on
disk (read back verified: disk or filesystem trouble is SpoolCorrupt).

Each island holds at most its share of both (IslandShare): the bound and the pool
split over the run's members, so one member whose push streams never finish (a
stolen island key) fills its own share, is refused SPOOL_FULL, and the others'
pushes still fit.

A coordinator's spool directory goes with it when it stops; one killed (SIGKILL,
the OOM killer) cannot remove it, so the next coordinator on the machine removes
the directories whose owner is gone (SpoolDir): a crash loop would
otherwise fill the disk with pushes nothing resumes from.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from diloco.wire.messages import payload_digest
from diloco.wire.refusal import Reason, Refused

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<QQQHI")  # offset, numel, XXH3-64 of the payload, name bytes, payload bytes
BLOCK_PAYLOAD = 8 << 20  # a pool block holds about this much payload: a whole number of the largest chunks
RECORD_SLACK = 256  # a record's bytes beyond its payload: its header and a name of up to 226 bytes

# An island may always hold this many fp32 pushes of the fragment it pushes to, with a quarter more for the records'
# headers, however many members share the spool: its contribution and a late one or a retry.
FLOOR_PUSHES = 2


def record_bytes(encoded_name: bytes, payload_bytes: int) -> int:
    """What one chunk takes of the spool and of its island's share: its record's header, its name (UTF-8) and its
    payload."""
    return _RECORD.size + len(encoded_name) + payload_bytes


SPOOL_DIR_PREFIX = "diloco-spool-"
OWNER_FILE = "owner.lock"  # locked by the process that made the directory for as long as it lives


@dataclass
class SpoolDir:
    """A spool directory this process made in the system's temporary directory (TMPDIR).

    Its owner file stays locked (flock) while the process lives, and the kernel
    drops the lock however the process ends, so another coordinator can tell a
    directory that was left behind, whatever the PID namespace, and no reused
    PID passes for its owner.
    """

    path: Path
    owner: IO[bytes]

    @classmethod
    def make(cls) -> SpoolDir:
        """A new directory, once those left by coordinators that were killed are removed."""
        remove_orphaned_spool_dirs(Path(tempfile.gettempdir()))
        path = Path(tempfile.mkdtemp(prefix=SPOOL_DIR_PREFIX))
        owner = open(path / (OWNER_FILE + ".new"), "wb")
        fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(path / (OWNER_FILE + ".new"), path / OWNER_FILE)  # never seen unlocked by another process's sweep
        return cls(path, owner)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.owner.close()


def remove_orphaned_spool_dirs(root: Path) -> list[Path]:
    """Removes root's spool directories whose owner file nobody holds locked; returns them. One without an owner
    file (being made, or made by an older release) is left alone."""
    removed = []
    for path in root.glob(SPOOL_DIR_PREFIX + "*"):
        try:
            owner = open(path / OWNER_FILE, "rb")
        except OSError:
            continue
        with owner:
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            except OSError:  # its coordinator is alive, or another coordinator starting removed it just now
                continue
            shutil.rmtree(path, ignore_errors=True)
        if path.exists():  # another user's, say: not ours to remove
            log.warning("could not remove %s, left by a coordinator that did not stop cleanly", path)
            continue
        log.info("removed %s (%.1f MB of pushes), left by a coordinator that did not stop cleanly", path, size / 1e6)
        removed.append(path)
    return removed


class SpoolCorrupt(OSError):
    """A spool file does not read back what was written (disk or filesystem trouble)."""


@dataclass
class SpooledChunk:
    name: str
    offset: int
    numel: int
    payload: memoryview  # valid until the next chunk is read (Spool.read), or, when stable, until discard()
    stable: bool = False  # in a pool block: another thread may decode it while the next ones are read


class BlockPool:
    """Blocks of memory for spools, reused once allocated: as many as max_bytes of payload in full-size chunks needs
    (at least one when max_bytes > 0), so the pool's memory is bounded whatever the number of islands.

    A block holds a whole number of records of the largest chunks (wire.chunk_bytes) with their headers: 8 MiB
    blocks held only seven 1 MiB records, and an eighth of a model's push went to disk.
    """

    def __init__(self, max_bytes: int, chunk_bytes: int = 1 << 20):
        per_block = max(1, BLOCK_PAYLOAD // chunk_bytes)
        self.block_bytes = per_block * (chunk_bytes + RECORD_SLACK)
        self.max_blocks = -(-max_bytes // (per_block * chunk_bytes))
        self.allocated = 0
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray | None:
        """A block, or None when the pool is spent."""
        with self._lock:
            if self._free:
                return self._free.pop()
            if self.allocated >= self.max_blocks:
                return None
            self.allocated += 1
        return bytearray(self.block_bytes)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def allocated_bytes(self) -> int:
        """The memory of the blocks allocated so far, held by spools or free (kept once allocated)."""
        return self.allocated * self.block_bytes

    @property
    def in_use_bytes(self) -> int:
        """The memory of the blocks spools hold now."""
        with self._lock:
            return (self.allocated - len(self._free)) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        """The most the pool allocates: max_blocks blocks."""
        return self.max_blocks * self.block_bytes

    def give_back(self, blocks: list[bytearray]) -> None:
        with self._lock:
            self._free.extend(blocks)


@dataclass(frozen=True)
class IslandShare:
    """What one island's pushes may hold of the spools: bytes (memory and disk) and blocks of the memory pool."""

    island: str
    bytes: int
    blocks: int
    members: int  # over how many members the spools were split


class Spools:
    """Where pushes spool, and the bytes they may take there, all islands together: memory (memory_bytes of payload,
    limits.spool_memory_models) first, then disk, at most limits.spool_gb in all; each island at most its share."""

    def __init__(self, directory: Path, max_bytes: int, memory_bytes: int = 0, chunk_bytes: int = 1 << 20):
        self.directory, self.max_bytes = directory, max_bytes
        self.pool = BlockPool(memory_bytes, chunk_bytes)
        self.used = 0
        self.held: dict[str, int] = {}  # bytes each island's spools hold
        self.blocks_held: dict[str, int] = {}  # pool blocks each island's spools hold
        self._lock = threading.Lock()

    def open(self, max_numel: int, island: str = "", members: int = 1) -> Spool:
        """A spool for one push stream of `island`, which may carry at most max_numel elements (its fragment's). The
        island's spools hold at most its share, the spools split over the run's `members`."""
        return Spool(self.directory, self, max_numel, self.share(island, max_numel, members))

    def share(self, island: str, max_numel: int, members: int) -> IslandShare:
        """An equal part of the bound and of the pool, and never less than FLOOR_PUSHES fp32 pushes of max_numel
        elements (a run of many members and a roomy spool refuses no honest push) nor one block."""
        members = max(1, members)
        floor = FLOOR_PUSHES * 5 * max_numel  # 4 bytes an element, and a quarter more for the records' headers
        return IslandShare(island, max(self.max_bytes // members, floor), max(1, -(-self.pool.max_blocks // members)), members)

    def reserve(self, n: int, share: IslandShare | None = None) -> None:
        with self._lock:
            if self.used + n > self.max_bytes:
                raise Refused(Reason.SPOOL_FULL, f"the coordinator's spool holds {self.used / 1e9:.2f} GB of pushes, its bound "
                              f"(limits.spool_gb = {self.max_bytes / 1e9:g}): this push was dropped; push again later")
            held = self.held.get(share.island, 0) if share is not None else 0
            if share is not None and held + n > share.bytes:
                raise Refused(Reason.SPOOL_FULL, f"{share.island}'s pushes hold {held / 1e6:.2f} MB of the coordinator's spool, "
                              f"its share ({share.bytes / 1e6:.2f} MB: limits.spool_gb over {share.members} members): this push "
                              "was dropped; end or cancel the pushes you left open, and push again")
            self.used += n
            if share is not None:
                self.held[share.island] = held + n

    def release(self, n: int, share: IslandShare | None = None) -> None:
        with self._lock:
            self.used -= n
            if share is not None:
                self._forget(self.held, share.island, n)

    def take_block(self, share: IslandShare | None = None) -> bytearray | None:
        """A block of the pool, or None when the pool is spent or the island holds its share of it."""
        with self._lock:
            if share is not None and self.blocks_held.get(share.island, 0) >= share.blocks:
                return None
            block = self.pool.take()
            if block is not None and share is not None:
                self.blocks_held[share.island] = self.blocks_held.get(share.island, 0) + 1
        return block

    def give_back(self, blocks: list[bytearray], share: IslandShare | None = None) -> None:
        self.pool.give_back(blocks)
        if share is not None and blocks:
            with self._lock:
                self._forget(self.blocks_held, share.island, len(blocks))

    @staticmethod
    def _forget(counts: dict[str, int], island: str, n: int) -> None:
        """Takes n off an island's count; an island holding nothing leaves the dict. Caller holds the lock."""
        left = counts.get(island, 0) - n
        if left > 0:
            counts[island] = left
        else:
            counts.pop(island, None)


class Spool:
    def __init__(self, directory: Path, spools: Spools | None = None, max_numel: int | None = None,
                 share: IslandShare | None = None):
        self.directory, self.share = directory, share
        self.path: Path | None = None  # the file, once records go to disk
        self._file = None
        self._blocks: list[tuple[bytearray, int]] = []  # pool blocks and the bytes written in each
        self.chunks = self.numel = self.bytes = 0
        self.spools, self.max_numel = spools, max_numel
        if spools is None:  # a spool of its own (tests): on disk
            self._open_file()

    def _open_file(self) -> None:
        fd, path = tempfile.mkstemp(prefix="push-", suffix=".spool", dir=self.directory)
        self.path, self._file = Path(path), os.fdopen(fd, "wb")

    def write(self, name: str, offset: int, numel: int, digest: int, payload: bytes) -> None:
        """One chunk whose payload was verified against its digest (diloco.wire.messages.payload_digest) already."""
        encoded = name.encode()
        if self.max_numel is not None and self.numel + numel > self.max_numel:
            # Bounds a stream that repeats chunks: overlaps are only found once the stream ends.
            raise Refused(Reason.BAD_CHUNK, f"the stream carries more than the {self.max_numel} elements its fragment has")
        size = record_bytes(encoded, len(payload))
        if self.spools is not None:
            self.spools.reserve(size, self.share)
        self.bytes += size
        self.numel += numel
        head = _RECORD.pack(offset, numel, digest, len(encoded), len(payload)) + encoded
        if not self._to_memory(head, payload, size):
            self._file.write(head)
            self._file.write(payload)
        self.chunks += 1

    def _to_memory(self, head: bytes, payload: bytes, size: int) -> bool:
        """Appends the record to this spool's last block, or to a new one from the pool; False once on disk."""
        if self._file is not None or self.spools is None:
            return False
        pool = self.spools.pool
        block, used = self._blocks[-1] if self._blocks else (None, pool.block_bytes)
        if used + size > pool.block_bytes:
            block = self.spools.take_block(self.share) if size <= pool.block_bytes else None
            if block is None:  # the pool (or the island's share) is spent: this record and the rest of the stream go to disk
                self._open_file()
                return False
            self._blocks.append((block, 0))
            used = 0
        # numpy copies without the GIL (a memoryview assignment holds it): many islands' streams spool at once.
        target = np.frombuffer(block, np.uint8)
        target[used : used + len(head)] = np.frombuffer(head, np.uint8)
        if len(payload):
            np.copyto(target[used + len(head) : used + size], np.frombuffer(payload, np.uint8))
        self._blocks[-1] = (block, used + size)
        return True

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def read(self) -> Iterator[SpooledChunk]:
        """The chunks in the order written. A payload in memory is a view of its block (valid until discard()); one
        from disk is a view of one reused buffer, valid until the next chunk is read, so the fold decodes it in place
        instead of allocating and copying per chunk."""
        self.close()
        for block, used in self._blocks:
            view, i = memoryview(block), 0
            while i < used:
                offset, numel, _, name_len, size = _RECORD.unpack_from(block, i)
                i += _RECORD.size
                name = bytes(view[i : i + name_len]).decode()
                i += name_len
                yield SpooledChunk(name, offset, numel, view[i : i + size], stable=True)
                i += size
        if self.path is None:
            return
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
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        if self.spools is not None:
            self.spools.give_back([block for block, _ in self._blocks], self.share)
            self.spools.release(self.bytes, self.share)
        self._blocks, self.bytes = [], 0
