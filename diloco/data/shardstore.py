"""ShardStore: a split's token stream read through fsspec, whole shards cached locally, prefetched.

- The cache is a directory of whole, verified shard files, at most `cache_bytes` of them (least
  recently used evicted first; a shard being read, or just downloaded, is never evicted, so
  only those can take it past the bound). A download goes to a `.part` name, is checked for
  size and checksum, then renamed: a killed process never leaves a cached shard that is
  trusted. A cached file is re-verified the first time a process opens it; a damaged one is
  deleted and downloaded again. The directory may be shared by processes (renames are atomic;
  each process keeps its own bound).
- A read of a shard that is not cached starts its download in the background and, when the
  format has block checksums, is served at once by ranged reads verified block by block, so
  a cold start does not wait for a whole shard. After each read the next `prefetch_shards`
  shards are downloaded in the background.
- A missing, truncated or corrupt shard raises DataError naming the shard's URL and what is
  wrong; a shard found corrupt stays refused for the life of the store.
- `read` is thread-safe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # download granularity
BLOCK_BYTES = 1 << 20  # the manifest's default: each block's checksum verifies a ranged read
BLOCK_CACHE = 8  # verified blocks kept for ranged reads (sequential reads mostly hit the last one)


@dataclass(frozen=True)
class Shard:
    url: str  # for messages
    path: str  # in the store's filesystem
    nbytes: int
    tokens: int
    hashes: dict[str, str] = field(default_factory=dict)  # algorithm -> hex digest of the whole file
    blocks: tuple[str, ...] | None = None  # XXH3-64 per block_bytes of the file; None: no ranged reads
    data_offset: int = 0  # where the tokens start in the file (for ranged reads)
    name: str = ""  # the cached file's name; defaults to the path with "/" as "__"

    @property
    def cache_name(self) -> str:
        return self.name or self.path.strip("/").replace("/", "__")


def hasher(algorithm: str):
    return getattr(xxhash, algorithm)() if algorithm.startswith("xxh") else hashlib.new(algorithm)


def check_hashes(shard: Shard, digests: dict[str, str]) -> None:
    for algorithm, want in shard.hashes.items():
        if digests[algorithm] != want:
            raise DataError(f"{shard.url}: checksum mismatch ({algorithm} {digests[algorithm]}, expected {want})")


class DataError(ValueError):
    """Token data that is missing, truncated, corrupt or inconsistent; the message names where and what."""


class _Closed(Exception):
    pass


class _Unusable(Exception):
    pass


class ShardStore:
    def __init__(self, fs, shards: list[Shard], dtype: np.dtype, cache_dir: Path, cache_bytes: int,
                 prefetch_shards: int = 2, *, vocab_size: int | None, eos_id: int | None,
                 load: Callable[[str, Shard], np.ndarray], block_bytes: int = BLOCK_BYTES,
                 max_open: int | None = None):
        self.fs, self.shards, self.dtype = fs, list(shards), np.dtype(dtype)
        self.vocab_size, self.eos_id = vocab_size, eos_id
        self.total = sum(s.tokens for s in self.shards)
        self.cache_dir, self.cache_bytes, self.prefetch_shards = Path(cache_dir), cache_bytes, prefetch_shards
        self.block_bytes = block_bytes
        self._load = load
        self._starts = np.cumsum([0] + [s.tokens for s in self.shards])
        self._lock = threading.RLock()  # a done-callback may run inline, under the lock, in _start_download
        self._cached: OrderedDict[int, int] = OrderedDict()  # shard -> bytes on disk, least recent first
        self._verified: set[int] = set()  # cached files checked by this process
        self._arrays: OrderedDict[int, np.ndarray] = OrderedDict()  # loaded shards (memmaps, or decoded)
        self._max_open = max_open or prefetch_shards + 2
        self._pins: Counter[int] = Counter()
        self._futures: dict[int, Future] = {}
        self._failed: dict[int, DataError] = {}
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()
        self._closed = False
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._adopt_cache()
        self._pool = ThreadPoolExecutor(max(2, min(prefetch_shards, 8)), thread_name_prefix="shardstore")

    # ---- the TokenStore interface

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split's stream (crossing shards as needed)."""
        if not 0 <= start <= stop <= self.total:
            raise IndexError(f"tokens [{start}, {stop}) are outside the stream's [0, {self.total})")
        out = np.empty(stop - start, self.dtype)
        pos, i = start, int(np.searchsorted(self._starts, start, side="right")) - 1
        while pos < stop:
            base = int(self._starts[i])
            end = min(stop, int(self._starts[i + 1]))
            if end > pos:
                out[pos - start:end - start] = self._piece(i, pos - base, end - base)
                pos = end
            i += 1
        if stop > start:
            self._schedule(range(i, min(i + self.prefetch_shards, len(self.shards))))
        return out

    def prefetch(self, start: int, stop: int) -> None:
        """Starts downloading the shards holding tokens [start, stop); returns at once."""
        start, stop = max(0, start), min(stop, self.total)
        if start < stop:
            first = int(np.searchsorted(self._starts, start, side="right")) - 1
            last = int(np.searchsorted(self._starts, stop, side="left")) - 1
            self._schedule(range(first, last + 1))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._arrays.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- whole shards

    def fetch(self, i: int) -> Path:
        """Blocks until shard i is in the cache; its path (it may be evicted once more shards arrive)."""
        while True:
            future = self._start_download(i)
            if future is None:
                return self._file(i)
            future.result()

    def is_cached(self, i: int) -> bool:
        with self._lock:
            return i in self._cached

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._cached.values())

    def _file(self, i: int) -> Path:
        return self.cache_dir / self.shards[i].cache_name

    def _adopt_cache(self) -> None:
        """Registers shards already cached (oldest use first) and removes .part files of dead processes."""
        found = []
        for i, shard in enumerate(self.shards):
            try:
                st = self._file(i).stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, i, st.st_size))
        for _, i, size in sorted(found):
            self._cached[i] = size
        for part in self.cache_dir.glob(".*.part"):
            pid = part.name.rsplit(".", 3)[-3]
            if pid.isdigit() and not _alive(int(pid)):
                part.unlink(missing_ok=True)
        with self._lock:
            self._evict(keep=-1)

    def _piece(self, i: int, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of shard i: from the cache, else by ranged reads while the shard downloads."""
        while True:
            array = self._acquire(i)
            if array is not None:
                try:
                    return np.array(array[a:b], self.dtype)
                finally:
                    with self._lock:
                        self._pins[i] -= 1
            future = self._start_download(i)
            if future is not None and self.shards[i].blocks is not None:
                try:
                    return self._ranged(i, a, b)
                except DataError as e:
                    with self._lock:
                        self._failed[i] = e
                    raise
            if future is not None:
                future.result()  # no block checksums (MDS): wait for the whole shard

    def _acquire(self, i: int) -> np.ndarray | None:
        """Shard i's tokens from the cache, pinned (the caller unpins); None when it is not cached."""
        with self._lock:
            if i in self._failed:
                raise self._failed[i]
            if i not in self._cached:
                return None
            self._pins[i] += 1
            self._cached.move_to_end(i)
            if i in self._arrays:
                self._arrays.move_to_end(i)
                return self._arrays[i]
            verified = i in self._verified
        path = str(self._file(i))
        try:
            try:
                if not verified:
                    self._verify_file(i, path)
                array = self._load(path, self.shards[i])
            except DataError as e:
                if verified:  # a checked file that does not decode: the shard itself is bad
                    with self._lock:
                        self._failed[i] = e
                    raise
                raise _Unusable(str(e)) from e
        except (FileNotFoundError, _Unusable) as e:
            # Damaged, or evicted by another process sharing the directory: drop it and download again.
            log.warning("cached shard %s is unusable (%s); downloading it again", self.shards[i].url, e)
            with self._lock:
                self._pins[i] -= 1
                self._forget(i)
            return None
        except BaseException:
            with self._lock:
                self._pins[i] -= 1
            raise
        with self._lock:
            self._verified.add(i)
            self._arrays[i] = array
            for j in [j for j in self._arrays if self._pins[j] == 0][:max(0, len(self._arrays) - self._max_open)]:
                del self._arrays[j]
        return array

    def _verify_file(self, i: int, path: str) -> None:
        shard = self.shards[i]
        size = os.path.getsize(path)
        if size != shard.nbytes:
            raise DataError(f"{path}: {size} bytes, expected {shard.nbytes}")
        hashers = {a: hasher(a) for a in shard.hashes}
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                for h in hashers.values():
                    h.update(chunk)
        check_hashes(shard, {a: h.hexdigest() for a, h in hashers.items()})

    def _forget(self, i: int) -> None:
        """Drops shard i from the cache (the lock held)."""
        self._cached.pop(i, None)
        self._arrays.pop(i, None)
        self._verified.discard(i)
        self._file(i).unlink(missing_ok=True)

    def _schedule(self, shards) -> None:
        for i in shards:
            try:
                self._start_download(i)
            except DataError:
                pass  # raised again when the shard is read

    def _start_download(self, i: int) -> Future | None:
        """The download of shard i, started if needed; None when it is cached (or the store is closed)."""
        with self._lock:
            if i in self._failed:
                raise self._failed[i]
            if i in self._cached or self._closed:
                return None
            future = self._futures.get(i)
            if future is None:
                future = self._futures[i] = self._pool.submit(self._download, i)
                future.add_done_callback(lambda f, i=i: self._downloaded(i, f))
            return future

    def _downloaded(self, i: int, future: Future) -> None:
        with self._lock:
            self._futures.pop(i, None)
            error = None if future.cancelled() else future.exception()
            if isinstance(error, DataError):
                self._failed[i] = error
        if error is not None and not isinstance(error, (DataError, _Closed)):
            log.warning("downloading %s failed (%s: %s); it will be tried again", self.shards[i].url,
                        type(error).__name__, error)

    def _download(self, i: int) -> None:
        shard = self.shards[i]
        part = self.cache_dir / f".{shard.cache_name}.{os.getpid()}.{threading.get_ident()}.part"
        hashers = {a: hasher(a) for a in shard.hashes}
        n = 0
        try:
            try:
                with self.fs.open(shard.path, "rb", block_size=CHUNK) as src, open(part, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        if self._closed:
                            raise _Closed()
                        n += len(chunk)
                        for h in hashers.values():
                            h.update(chunk)
                        dst.write(chunk)
            except FileNotFoundError:
                raise DataError(f"{shard.url}: missing") from None
            if n != shard.nbytes:
                raise DataError(f"{shard.url}: {n} bytes, expected {shard.nbytes}")
            check_hashes(shard, {a: h.hexdigest() for a, h in hashers.items()})
            os.replace(part, self._file(i))
        except DataError as e:
            # Refused from now on, before whoever waits on the future learns it: a read right after must not take
            # the finished download (still in _futures until _downloaded runs) for one in flight.
            with self._lock:
                self._failed[i] = e
            raise
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            self._cached[i] = n
            self._cached.move_to_end(i)
            self._verified.add(i)
            self._evict(keep=i)
        log.debug("cached %s (%d bytes)", shard.url, n)

    def _evict(self, keep: int) -> None:
        """Least recently used whole shards out until the cache fits (the lock held); never a pinned one."""
        total = sum(self._cached.values())
        for j in list(self._cached):
            if total <= self.cache_bytes:
                break
            if j != keep and self._pins[j] == 0:
                total -= self._cached[j]
                self._forget(j)

    # ---- ranged reads, verified block by block

    def _ranged(self, i: int, a: int, b: int) -> np.ndarray:
        shard, width, size = self.shards[i], self.dtype.itemsize, self.block_bytes
        lo, hi = shard.data_offset + a * width, shard.data_offset + b * width
        first, last = lo // size, (hi - 1) // size
        with self._lock:
            have = {k: self._blocks[(i, k)] for k in range(first, last + 1) if (i, k) in self._blocks}
        missing = [k for k in range(first, last + 1) if k not in have]
        if missing:
            have.update(self._fetch_blocks(i, missing[0], missing[-1]))
        data = b"".join(have[k] for k in range(first, last + 1))
        return np.frombuffer(data, self.dtype, count=b - a, offset=lo - first * size)

    def _fetch_blocks(self, i: int, first: int, last: int) -> dict[int, bytes]:
        shard, size = self.shards[i], self.block_bytes
        start, end = first * size, min((last + 1) * size, shard.nbytes)
        try:
            data = self.fs.cat_file(shard.path, start=start, end=end)
        except FileNotFoundError:
            raise DataError(f"{shard.url}: missing") from None
        if len(data) != end - start:
            try:
                actual = self.fs.size(shard.path)
            except FileNotFoundError:
                raise DataError(f"{shard.url}: missing") from None
            raise DataError(f"{shard.url}: {actual} bytes, expected {shard.nbytes}")
        blocks = {}
        for k in range(first, last + 1):
            block = data[(k - first) * size:(k - first + 1) * size]
            if xxhash.xxh3_64_hexdigest(block) != shard.blocks[k]:
                raise DataError(f"{shard.url}: checksum mismatch in block {k} (bytes {k * size}-{k * size + len(block)})")
            blocks[k] = block
        with self._lock:
            for k, block in blocks.items():
                self._blocks[(i, k)] = block
                self._blocks.move_to_end((i, k))
            while len(self._blocks) > BLOCK_CACHE:
                self._blocks.popitem(last=False)
        return blocks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
