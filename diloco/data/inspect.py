"""Checking a dataset: its summary, and every shard's size and checksums against what its index records.

Ours (manifest.json: each shard's xxh3-128 and per-block xxh3-64) and MosaicML MDS (index.json: the
hashes its writer recorded). `diloco-data inspect URL` runs `inspect`.
"""

from __future__ import annotations

import json

import fsspec
import xxhash

from diloco.data.mds import find_mds_index, known_hashes
from diloco.data.shards import BLOCK_BYTES, MANIFEST, DataError, read_manifest
from diloco.data.shardstore import CHUNK, Shard, check_hashes, hasher


def inspect(url: str, verify: bool = True) -> int:
    """Prints the dataset's summary; with verify, downloads every shard and checks it. 1 if any is bad."""
    url = url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    shards: list[tuple[Shard, tuple[str, ...] | None, int]] = []
    if fs.exists(f"{root}/{MANIFEST}"):
        manifest, _ = read_manifest(url)
        print(f"{url}: diloco tokens, vocab_size {manifest.vocab_size}, eos_id {manifest.eos_id} "
              f"({manifest.eos_token!r}), {manifest.dtype.name}, tokenizer sha256 {manifest.tokenizer_sha256[:16]}")
        for name, split in sorted(manifest.splits.items()):
            print(f"  {name}: {split.tokens} tokens, {split.documents} documents, {len(split.shards)} shards, "
                  f"{sum(s.bytes for s in split.shards)} bytes")
            shards += [(Shard(f"{url}/{s.file}", f"{root}/{s.file}", s.bytes, s.tokens, {"xxh3_128": s.xxh3_128}),
                        s.blocks_xxh3_64, manifest.block_bytes) for s in split.shards]
    else:
        indexes = {split: find_mds_index(fs, root, split) for split in ("train", "eval")}
        if not any(indexes.values()):
            raise DataError(f"{url}: no {MANIFEST} (ours) or index.json (MDS)")
        for split, index in indexes.items():
            if index is None:
                continue
            infos = json.loads(fs.cat_file(index))["shards"]
            base = index.rsplit("/", 1)[0]
            print(f"{fs.unstrip_protocol(index)}: MDS, {len(infos)} shards, {sum(i['samples'] for i in infos)} samples, "
                  f"columns {infos[0]['column_names'] if infos else []} {infos[0]['column_encodings'] if infos else []}, "
                  f"compression {infos[0].get('compression') if infos else None}")
            for info in infos:
                file = info["zip_data"] if info.get("compression") else info["raw_data"]
                shards.append((Shard(fs.unstrip_protocol(f"{base}/{file['basename']}"), f"{base}/{file['basename']}",
                                     int(file["bytes"]), 0, known_hashes(file.get("hashes"))), None, BLOCK_BYTES))
    if not verify:
        return 0
    bad = 0
    for shard, blocks, block_bytes in shards:
        try:
            verify_shard(fs, shard, blocks, block_bytes)
        except DataError as e:
            bad += 1
            print(f"  BAD {e}")
    print(f"  verified {len(shards) - bad} of {len(shards)} shards" + (f"; {bad} bad" if bad else ""))
    return 1 if bad else 0


def verify_shard(fs, shard: Shard, blocks: tuple[str, ...] | None, block_bytes: int) -> None:
    """Downloads one shard (streaming) and checks its size, checksums and block checksums."""
    hashers = {a: hasher(a) for a in shard.hashes}
    n, k, carry = 0, 0, b""
    try:
        with fs.open(shard.path, "rb", block_size=CHUNK) as f:
            while chunk := f.read(CHUNK):
                n += len(chunk)
                for h in hashers.values():
                    h.update(chunk)
                if blocks is not None:
                    carry += chunk
                    while len(carry) >= block_bytes:
                        _check_block(shard, blocks, k, carry[:block_bytes])
                        carry, k = carry[block_bytes:], k + 1
    except FileNotFoundError:
        raise DataError(f"{shard.url}: missing") from None
    if n != shard.nbytes:
        raise DataError(f"{shard.url}: {n} bytes, expected {shard.nbytes}")
    if blocks is not None and (carry or k == 0):
        _check_block(shard, blocks, k, carry)
    check_hashes(shard, {a: h.hexdigest() for a, h in hashers.items()})


def _check_block(shard: Shard, blocks: tuple[str, ...], k: int, data: bytes) -> None:
    if k >= len(blocks) or xxhash.xxh3_64_hexdigest(data) != blocks[k]:
        raise DataError(f"{shard.url}: checksum mismatch in block {k}")
