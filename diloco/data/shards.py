"""Token shards and their manifest: the on-disk format `diloco-data prepare` writes, and `open_store`.

A dataset lives at one fsspec URL (a local path or s3://bucket/prefix):

    manifest.json            written last: a dataset without it is not finished
    tokenizer.json           the Hugging Face `tokenizers` file the tokens came from
    train/shard-00000.bin    the training split's token stream, cut into shards
    eval/shard-00000.bin     the held-out split (documents chosen by a hash of their text)

A shard is a 16-byte header, then the tokens, little-endian:

    offset 0   4 bytes  magic b"DLTK"
    offset 4   uint16   format version (1)
    offset 6   uint16   token width in bytes: 2 (uint16, vocab_size <= 65536) or 4 (uint32)
    offset 8   uint64   token count
    offset 16  count * width bytes of tokens

Each document's tokens are followed by the end-of-document token (`eos_id`); a split is the
concatenation of its shards in order, and documents cross shard boundaries freely.

manifest.json (keys sorted): `format` ("diloco-tokens"), `version` (1), `tokenizer`
({"file": "tokenizer.json", "sha256": hex}), `vocab_size`, `eos_id`, `eos_token`, `dtype`
("uint16" or "uint32"), `block_bytes` (1 MiB), and `splits`: for "train" and "eval",
{"tokens", "documents", "shards": [{"file", "tokens", "bytes", "xxh3_128", "blocks_xxh3_64"}]}.
`xxh3_128` is the whole shard file's XXH3-128; `blocks_xxh3_64` the XXH3-64 of each
`block_bytes`-sized block of the file from byte 0 (the last one shorter), so a ranged read is
verified without downloading the whole shard. The checksums catch corruption and truncation,
not an adversary. MosaicML MDS datasets (an `index.json` at the URL) are read too: diloco/data/mds.py.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import xxhash

from diloco.data.mds import find_mds_index, open_mds
from diloco.data.samples import TokenStore
# DataError lives with the store (which raises most of them) and is the one error of this module too.
from diloco.data.shardstore import BLOCK_BYTES, DataError, Shard, ShardStore

MAGIC = b"DLTK"
FORMAT = "diloco-tokens"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQ")  # magic, version, token width, token count
SPLITS = ("train", "eval")
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
DEFAULT_CACHE = Path("~/.cache/diloco/tokens")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def encode_shard(tokens: np.ndarray, dtype: np.dtype) -> bytes:
    """A shard file's bytes: the header, then the tokens in dtype, little-endian."""
    dtype = np.dtype(dtype).newbyteorder("<")
    return HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, len(tokens)) + np.asarray(tokens).astype(dtype).tobytes()


def parse_header(data: bytes, where: str) -> tuple[int, int]:
    """(token width, token count) from a shard's first 16 bytes; DataError when they are not a shard header."""
    if len(data) < HEADER.size:
        raise DataError(f"{where}: {len(data)} bytes, shorter than a shard header ({HEADER.size})")
    magic, version, width, count = HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or width not in (2, 4):
        raise DataError(f"{where}: not a diloco token shard (magic {magic!r}, version {version}, width {width})")
    return width, count


def block_checksums(data: bytes | memoryview, block_bytes: int = BLOCK_BYTES) -> list[str]:
    view = memoryview(data)
    return [xxhash.xxh3_64_hexdigest(view[i:i + block_bytes]) for i in range(0, max(len(view), 1), block_bytes)]


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the dataset root, e.g. "train/shard-00000.bin"
    tokens: int
    bytes: int
    xxh3_128: str
    blocks_xxh3_64: tuple[str, ...]

    @classmethod
    def of(cls, file: str, data: bytes, tokens: int, block_bytes: int = BLOCK_BYTES) -> ShardInfo:
        return cls(file, tokens, len(data), xxhash.xxh3_128_hexdigest(data), tuple(block_checksums(data, block_bytes)))

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "bytes": self.bytes, "xxh3_128": self.xxh3_128,
                "blocks_xxh3_64": list(self.blocks_xxh3_64)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShardInfo:
        return cls(d["file"], int(d["tokens"]), int(d["bytes"]), d["xxh3_128"], tuple(d["blocks_xxh3_64"]))


@dataclass(frozen=True)
class SplitInfo:
    shards: tuple[ShardInfo, ...] = ()
    documents: int = 0

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "documents": self.documents, "shards": [s.to_dict() for s in self.shards]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitInfo:
        return cls(tuple(ShardInfo.from_dict(s) for s in d["shards"]), int(d.get("documents", 0)))


@dataclass(frozen=True)
class Manifest:
    tokenizer_sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    block_bytes: int = BLOCK_BYTES
    tokenizer_file: str = TOKENIZER

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def to_json(self) -> str:
        obj = {
            "format": FORMAT, "version": FORMAT_VERSION,
            "tokenizer": {"file": self.tokenizer_file, "sha256": self.tokenizer_sha256},
            "vocab_size": self.vocab_size, "eos_id": self.eos_id, "eos_token": self.eos_token,
            "dtype": self.dtype.name, "block_bytes": self.block_bytes,
            "splits": {name: split.to_dict() for name, split in sorted(self.splits.items())},
        }
        return json.dumps(obj, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
        try:
            obj = json.loads(text)
            if obj.get("format") != FORMAT or obj.get("version") != FORMAT_VERSION:
                raise DataError(f"{where}: not a {FORMAT} v{FORMAT_VERSION} manifest "
                                f"(format {obj.get('format')!r}, version {obj.get('version')!r})")
            manifest = cls(
                tokenizer_sha256=obj["tokenizer"]["sha256"], tokenizer_file=obj["tokenizer"]["file"],
                vocab_size=int(obj["vocab_size"]), eos_id=int(obj["eos_id"]), eos_token=obj["eos_token"],
                block_bytes=int(obj["block_bytes"]),
                splits={name: SplitInfo.from_dict(s) for name, s in obj["splits"].items()},
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{where}: unreadable manifest ({type(e).__name__}: {e})") from e
        if manifest.dtype.name != obj.get("dtype"):
            raise DataError(f"{where}: dtype {obj.get('dtype')!r} does not fit vocab_size {manifest.vocab_size}")
        return manifest


def read_manifest(url: str, storage_options: dict | None = None) -> tuple[Manifest, bytes]:
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    where = f"{url.rstrip('/')}/{MANIFEST}"
    try:
        raw = fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        raise DataError(f"{where}: missing (is this a dataset made by `diloco-data prepare`?)") from None
    return Manifest.from_json(raw.decode(), where), raw


def open_store(url: str, split: str = "train", cache_dir: str | os.PathLike | None = None,
               cache_bytes: int = 8 << 30, prefetch_shards: int = 2, *, vocab_size: int | None = None,
               eos_id: int | None = None, column: str | None = None, mds_append_eos: bool = False,
               storage_options: dict | None = None) -> TokenStore:
    """One split ("train" or "eval") of the dataset at url, streamed through a local cache.

    A `manifest.json` at url is a dataset of ours; an `index.json` (at url or url/<split>) is a
    MosaicML MDS dataset. Ours: vocab_size and eos_id come from the manifest, and passing other
    values is a DataError. MDS: they are not in the dataset, so they are what is passed (None when
    not). cache_dir is the root of the caches (default ~/.cache/diloco/tokens); each dataset caches
    whole shards under <cache_dir>/<digest of its manifest or index>/, at most cache_bytes of them
    (more only while shards are being read). prefetch_shards: how many shards past the last read
    to download in the background.
    """
    url = url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE.expanduser()
    if not fs.exists(f"{root}/{MANIFEST}"):
        index = find_mds_index(fs, root, split)
        if index is None:
            raise DataError(f"{url}: no {MANIFEST} (ours) or index.json (MDS) for split {split!r}; "
                            "make one with `diloco-data prepare`")
        return open_mds(fs, url, index, split, cache_root, cache_bytes, prefetch_shards,
                        vocab_size=vocab_size, eos_id=eos_id, column=column, append_eos=mds_append_eos)
    manifest, raw = read_manifest(url, storage_options)
    for name, given, have in (("vocab_size", vocab_size, manifest.vocab_size), ("eos_id", eos_id, manifest.eos_id)):
        if given is not None and given != have:
            raise DataError(f"{url}/{MANIFEST}: {name} is {have}, not the {given} asked for")
    if split not in manifest.splits:
        raise DataError(f"{url}/{MANIFEST}: no split {split!r} (has {sorted(manifest.splits)})")
    dtype = manifest.dtype
    shards = [Shard(url=f"{url}/{s.file}", path=f"{root}/{s.file}", nbytes=s.bytes, tokens=s.tokens,
                    hashes={"xxh3_128": s.xxh3_128}, blocks=s.blocks_xxh3_64, data_offset=HEADER.size)
              for s in manifest.splits[split].shards]
    return ShardStore(fs, shards, dtype, cache_root / xxhash.xxh3_64_hexdigest(raw), cache_bytes,
                      prefetch_shards, vocab_size=manifest.vocab_size, eos_id=manifest.eos_id,
                      block_bytes=manifest.block_bytes, load=load_shard_file)


def load_shard_file(path: str, shard: Any) -> np.ndarray:
    """A verified cached shard's tokens, memory-mapped (read-only)."""
    with open(path, "rb") as f:
        width, count = parse_header(f.read(HEADER.size), shard.url)
    if count != shard.tokens:
        raise DataError(f"{shard.url}: header says {count} tokens, the manifest {shard.tokens}")
    if count == 0:
        return np.zeros(0, np.dtype(f"<u{width}"))
    return np.memmap(path, dtype=np.dtype(f"<u{width}"), mode="r", offset=HEADER.size, shape=(count,))
