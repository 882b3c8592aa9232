"""MosaicML MDS datasets (mosaicml-streaming's MDSWriter) read as a TokenStore, without the library.

We read the documented format ourselves (streaming/base/format/mds/{writer,reader,encodings}.py):
the library would pull torch 2.14 and CUDA wheels into this environment, and its StreamingDataset
brings its own cache, shared memory and partitioning, where we need a token stream read through
ShardStore's verified cache.

Layout: `index.json` ({"version": 2, "shards": [...]}) at the dataset root, or at <root>/<split>/
(for split "eval" also val/ or validation/); a root index serves split "train". Each shard entry
names its file (`raw_data`, or `zip_data` when `compression` is set: zstd, gz or bz2 here), its
bytes and optional hashes, its sample count and its columns. A shard file is uint32 sample count
n, uint32 offsets[n + 1] (from the file's start), the JSON config, then the samples; a sample is
one uint32 size per variable-size column, then each column's bytes in column order. The token
column is `ndarray[:dtype[:shape]]` of an integer dtype (when the dtype is not fixed, one byte
codes it; when the shape is not fixed, one byte (ndim << 2 | width code) and the shape precede
the values).

The token stream is the samples' tokens concatenated in order. Pipelines like the seed one write
fixed-length chunks of a stream that already holds the end-of-document tokens, so nothing is
added between samples unless `append_eos` says the samples are whole documents. Per-shard token
counts are known from the index when the column's shape is fixed; otherwise the shards are read
once at open and their counts kept in the cache directory (mds-counts.json).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from diloco.data.shardstore import DataError, Shard, ShardStore

log = logging.getLogger(__name__)

INDEX = "index.json"
EVAL_DIRS = ("eval", "val", "validation")
SHAPE_DTYPES = {0: np.uint8, 1: np.uint16, 2: np.uint32, 3: np.uint64}
VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 32: "uint32", 33: "int32", 64: "uint64", 65: "int64"}


def find_mds_index(fs, root: str, split: str) -> str | None:
    """The path of the index.json holding split, or None."""
    for sub in EVAL_DIRS if split == "eval" else (split,):
        if fs.exists(f"{root}/{sub}/{INDEX}"):
            return f"{root}/{sub}/{INDEX}"
    return f"{root}/{INDEX}" if split == "train" and fs.exists(f"{root}/{INDEX}") else None


def parse_ndarray(encoding: str, where: str) -> tuple[str | None, tuple[int, ...] | None]:
    """(dtype, shape) of an `ndarray[:dtype[:shape]]` encoding, None where not fixed."""
    parts = encoding.split(":")
    if parts[0] != "ndarray" or len(parts) > 3:
        raise DataError(f"{where}: token column encoding {encoding!r} is not ndarray[:dtype[:shape]]")
    dtype = parts[1] if len(parts) > 1 else None
    if dtype is not None and dtype not in VALUE_DTYPES.values():
        raise DataError(f"{where}: token column dtype {dtype!r} is not an integer type")
    shape = tuple(int(d) for d in parts[2].split(",")) if len(parts) > 2 else None
    return dtype, shape


def _pick_column(info: dict, column: str | None, where: str) -> int:
    names = info["column_names"]
    if column is None:
        arrays = [n for n, e in zip(names, info["column_encodings"]) if e.startswith("ndarray")]
        column = "tokens" if "tokens" in names else (arrays[0] if len(arrays) == 1 else None)
    if column not in names:
        raise DataError(f"{where}: no token column {column!r} among {names}; name it (column=...)")
    return names.index(column)


def decode_shard(raw: bytes, info: dict, col: int, dtype: np.dtype, append_eos: bool, eos_id: int | None,
                 where: str) -> np.ndarray:
    """The token column of every sample of one (decompressed) MDS shard, concatenated."""
    n = int(np.frombuffer(raw, np.uint32, 1)[0])
    offsets = np.frombuffer(raw, np.uint32, n + 1, 4)
    sizes_fixed = info["column_sizes"]
    dynamic = [k for k, s in enumerate(sizes_fixed) if s is None]
    value_dtype, shape = parse_ndarray(info["column_encodings"][col], where)
    pieces = []
    for k in range(n):
        sample = memoryview(raw)[offsets[k]:offsets[k + 1]]
        head = np.frombuffer(sample, np.uint32, len(dynamic)) if dynamic else ()
        sizes = list(sizes_fixed)
        for d, size in zip(dynamic, head):
            sizes[d] = int(size)
        at = 4 * len(dynamic) + sum(sizes[:col])
        body = sample[at:at + sizes[col]]
        pos, vdt = 0, value_dtype
        if vdt is None:
            vdt, pos = VALUE_DTYPES[body[0]], 1
        if shape is None:
            ndim, code = body[pos] >> 2, body[pos] & 3
            pos += 1 + ndim * np.dtype(SHAPE_DTYPES[code]).itemsize
        pieces.append(np.frombuffer(body[pos:], np.dtype(vdt).newbyteorder("<")))
        if append_eos:
            pieces.append(np.array([eos_id], dtype))
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)


def decompress(data: bytes, compression: str | None, raw_bytes: int, where: str) -> bytes:
    kind = (compression or "").split(":")[0]
    if not kind:
        return data
    if kind == "zstd":
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_bytes)
    if kind == "gz":
        return gzip.decompress(data)
    if kind == "bz2":
        return bz2.decompress(data)
    raise DataError(f"{where}: MDS compression {compression!r} is not supported (zstd, gz, bz2 are)")


def load_mds_file(path: str, shard: Shard, *, info: dict, col: int, dtype: np.dtype, append_eos: bool,
                  eos_id: int | None) -> np.ndarray:
    with open(path, "rb") as f:
        data = f.read()
    try:
        raw = decompress(data, info.get("compression"), info["raw_data"]["bytes"], shard.url)
        if len(raw) != info["raw_data"]["bytes"]:
            raise DataError(f"{shard.url}: {len(raw)} bytes decompressed, expected {info['raw_data']['bytes']}")
        return decode_shard(raw, info, col, dtype, append_eos, eos_id, shard.url)
    except (zstandard.ZstdError, OSError, EOFError, ValueError, IndexError, KeyError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{shard.url}: undecodable MDS shard ({type(e).__name__}: {e})") from e


def known_hashes(hashes: dict) -> dict[str, str]:
    return {a: h for a, h in (hashes or {}).items()
            if (a.startswith("xxh") and hasattr(xxhash, a)) or a in hashlib.algorithms_available}


def open_mds(fs, url: str, index_path: str, split: str, cache_root: Path, cache_bytes: int, prefetch_shards: int,
             *, vocab_size: int | None, eos_id: int | None, column: str | None, append_eos: bool) -> ShardStore:
    where = fs.unstrip_protocol(index_path)
    raw_index = fs.cat_file(index_path)
    try:
        index = json.loads(raw_index)
        infos = index["shards"]
        if index.get("version") != 2 or any(s.get("format") != "mds" for s in infos):
            raise DataError(f"{where}: not an MDS v2 index (version {index.get('version')!r}, formats "
                            f"{sorted({str(s.get('format')) for s in infos})})")
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{where}: unreadable MDS index ({type(e).__name__}: {e})") from e
    if append_eos and eos_id is None:
        raise DataError(f"{where}: appending an end-of-document token between samples needs eos_id")
    base = index_path.rsplit("/", 1)[0]
    sub = base[len(fs._strip_protocol(url)):].strip("/")
    cols = [_pick_column(info, column, where) for info in infos]
    dtypes = {parse_ndarray(info["column_encodings"][c], where) for info, c in zip(infos, cols)}
    value_dtypes = {d for d, _ in dtypes}
    dtype = np.dtype(value_dtypes.pop() if len(value_dtypes) == 1 and None not in value_dtypes else "int64")
    shards = []
    for info in infos:
        file = info["zip_data"] if info.get("compression") else info["raw_data"]
        shards.append(Shard(url=f"{url}/{sub + '/' if sub else ''}{file['basename']}", path=f"{base}/{file['basename']}",
                            nbytes=int(file["bytes"]), tokens=0, hashes=known_hashes(file.get("hashes")),
                            name=f"{sub.replace('/', '__')}__{file['basename']}" if sub else file["basename"]))
    cache_dir = cache_root / xxhash.xxh3_64_hexdigest(raw_index)
    loads = [partial(load_mds_file, info=info, col=c, dtype=dtype, append_eos=append_eos, eos_id=eos_id)
             for info, c in zip(infos, cols)]

    def load(path: str, shard: Shard) -> np.ndarray:
        return loads[shards_by_url[shard.url]](path, shard)

    shards_by_url = {s.url: k for k, s in enumerate(shards)}
    counts = _token_counts(fs, infos, cols, shards, dtype, cache_dir, cache_bytes, load, append_eos, where)
    shards = [replace(s, tokens=n) for s, n in zip(shards, counts)]
    return ShardStore(fs, shards, dtype, cache_dir, cache_bytes, prefetch_shards, vocab_size=vocab_size,
                      eos_id=eos_id, load=load)


def _token_counts(fs, infos, cols, shards, dtype, cache_dir: Path, cache_bytes: int, load, append_eos: bool,
                  where: str) -> list[int]:
    """Tokens per shard: from the index when the token shape is fixed, else by reading each shard once."""
    fixed = []
    for info, c in zip(infos, cols):
        _, shape = parse_ndarray(info["column_encodings"][c], where)
        fixed.append(None if shape is None else info["samples"] * (int(np.prod(shape)) + append_eos))
    if None not in fixed:
        return fixed
    key = {"columns": [info["column_names"][c] for info, c in zip(infos, cols)], "append_eos": append_eos}
    memo = cache_dir / "mds-counts.json"
    try:
        saved = json.loads(memo.read_text())
        if saved["key"] == key:
            return saved["counts"]
    except (FileNotFoundError, ValueError, KeyError):
        pass
    log.info("%s: counting the tokens of %d MDS shards (once; kept in %s)", where, len(shards), memo)
    with ShardStore(fs, shards, dtype, cache_dir, cache_bytes, 2, vocab_size=None, eos_id=None, load=load) as scan:
        for k in range(len(shards)):
            if fixed[k] is None:
                fixed[k] = len(load(str(scan.fetch(k)), shards[k]))
    tmp = memo.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "counts": fixed}))
    tmp.replace(memo)
    return fixed
