"""Token shards read back: the format, ShardStore's cache, prefetch and ranged reads, errors, and MDS datasets."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import zstandard

from diloco.data.shards import DataError, Manifest, ShardInfo, SplitInfo, encode_shard, open_store

DATA = Path(__file__).resolve().parent / "data"


def write_dataset(url: str, splits: dict[str, np.ndarray], shard_tokens: int, vocab_size: int = 1000,
                  block_bytes: int = 1 << 20) -> Manifest:
    """A dataset of ours at url holding the given token streams (no tokenizer needed to read it)."""
    fs, root = fsspec.core.url_to_fs(url)
    infos = {}
    dtype = np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")
    for name, tokens in splits.items():
        fs.makedirs(f"{root}/{name}", exist_ok=True)
        shards = []
        for k, at in enumerate(range(0, len(tokens), shard_tokens)):
            data = encode_shard(tokens[at:at + shard_tokens], dtype)
            file = f"{name}/shard-{k:05d}.bin"
            fs.pipe_file(f"{root}/{file}", data)
            shards.append(ShardInfo.of(file, data, len(tokens[at:at + shard_tokens]), block_bytes))
        infos[name] = SplitInfo(tuple(shards), documents=1)
    manifest = Manifest("0" * 64, vocab_size, 0, "<eos>", infos, block_bytes)
    fs.pipe_file(f"{root}/tokenizer.json", b"{}")
    fs.pipe_file(f"{root}/manifest.json", manifest.to_json().encode())
    return manifest


def stream(n: int, seed: int = 0, vocab_size: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, n)


@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.unit),
                        pytest.param("s3", marks=pytest.mark.integration)])  # s3: a moto server on 127.0.0.1
def base(request, tmp_path):
    return str(tmp_path / "data") if request.param == "local" else request.getfixturevalue("s3") + "/data"


@pytest.mark.unit
def test_manifest_round_trips_and_refuses_what_it_is_not():
    m = Manifest("ab" * 32, 70000, 3, "<eos>", {"train": SplitInfo((ShardInfo.of("train/shard-00000.bin",
                 encode_shard(np.arange(5), np.dtype("<u4")), 5),), 2)})
    assert Manifest.from_json(m.to_json()) == m
    assert m.dtype == np.dtype("<u4") and json.loads(m.to_json())["splits"]["train"]["tokens"] == 5
    with pytest.raises(DataError, match="not a diloco-tokens"):
        Manifest.from_json(json.dumps({"format": "other"}))


def test_reads_equal_the_tokens_across_shard_boundaries(base, tmp_path):
    train, held = stream(10_000, 1), stream(777, 2)
    write_dataset(base, {"train": train, "eval": held}, shard_tokens=1000, block_bytes=512)
    with open_store(base, "train", cache_dir=tmp_path / "cache") as store:
        assert (store.total, store.vocab_size, store.eos_id) == (10_000, 1000, 0)
        rng = np.random.default_rng(3)
        for _ in range(40):  # cold (ranged) and cached reads, many crossing shards
            a = int(rng.integers(0, 10_000))
            b = int(rng.integers(a, min(10_000, a + 2500) + 1))
            assert np.array_equal(store.read(a, b), train[a:b])
        assert np.array_equal(store.read(0, 10_000), train) and len(store.read(5, 5)) == 0
        with pytest.raises(IndexError):
            store.read(9_990, 10_001)
    with open_store(base, "eval", cache_dir=tmp_path / "cache") as store:
        assert np.array_equal(store.read(0, 777), held)


class GatedFS:
    """Wraps a filesystem: whole-file downloads wait for `gate`; ranged reads are counted."""

    def __init__(self, fs):
        self.fs, self.gate, self.ranged, self.opens = fs, threading.Event(), 0, 0

    def open(self, *args, **kwargs):
        self.opens += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self.fs.open(*args, **kwargs)

    def cat_file(self, *args, **kwargs):
        self.ranged += 1
        return self.fs.cat_file(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


@pytest.mark.unit
def test_cold_read_is_served_by_verified_ranged_reads_while_the_shard_downloads(tmp_path):
    tokens = stream(200_000)
    write_dataset(str(tmp_path / "d"), {"train": tokens}, shard_tokens=100_000, block_bytes=4096)
    store = open_store(str(tmp_path / "d"), cache_dir=tmp_path / "cache", prefetch_shards=1)
    gated = store.fs = GatedFS(store.fs)
    try:
        # The whole-shard download is held at the gate, yet the reads return: ranged reads.
        assert np.array_equal(store.read(10, 1035), tokens[10:1035])
        assert np.array_equal(store.read(1035, 2060), tokens[1035:2060])
        assert gated.ranged >= 1 and not store.is_cached(0)
        gated.gate.set()
        store.fetch(0)
        before = gated.ranged
        assert np.array_equal(store.read(5000, 6025), tokens[5000:6025])
        assert gated.ranged == before  # now from the cache
    finally:
        gated.gate.set()
        store.close()


def wait_until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_prefetch_downloads_ahead_in_the_background(base, tmp_path):
    tokens = stream(6000)
    write_dataset(base, {"train": tokens}, shard_tokens=1000)
    with open_store(base, cache_dir=tmp_path / "cache", prefetch_shards=2) as store:
        store.read(0, 10)  # shard 0, and the next two in the background
        wait_until(lambda: all(store.is_cached(i) for i in (0, 1, 2)))
        assert not store.is_cached(4)
        store.prefetch(4500, 5500)
        wait_until(lambda: store.is_cached(4) and store.is_cached(5))
        gated = store.fs = GatedFS(store.fs)
        assert np.array_equal(store.read(4000, 6000), tokens[4000:6000])
        assert gated.ranged == 0


@pytest.mark.unit
def test_cache_is_bounded_by_bytes_least_recently_used_out(tmp_path):
    tokens = stream(8000)
    manifest = write_dataset(str(tmp_path / "d"), {"train": tokens}, shard_tokens=1000)
    shard_bytes = manifest.splits["train"].shards[0].bytes
    bound = int(2.5 * shard_bytes)
    with open_store(str(tmp_path / "d"), cache_dir=tmp_path / "cache", cache_bytes=bound, prefetch_shards=0) as store:
        for i in range(8):
            store.fetch(i)
            assert np.array_equal(store.read(i * 1000, i * 1000 + 1000), tokens[i * 1000:(i + 1) * 1000])
            on_disk = sum(f.stat().st_size for f in store.cache_dir.iterdir() if f.is_file() and f.suffix == ".bin")
            assert store.cached_bytes() <= bound and on_disk <= bound
        assert [store.is_cached(i) for i in range(8)] == [False] * 6 + [True] * 2
        store.read(6000, 6001)  # shard 6 is now the most recent: fetching 1 evicts 7
        store.fetch(1)
        assert [store.is_cached(i) for i in (1, 6, 7)] == [True, True, False]


@pytest.mark.unit
def test_concurrent_reads_with_evictions_are_right(tmp_path):
    tokens = stream(20_000)
    manifest = write_dataset(str(tmp_path / "d"), {"train": tokens}, shard_tokens=1000, block_bytes=256)
    bound = 3 * manifest.splits["train"].shards[0].bytes
    errors = []
    with open_store(str(tmp_path / "d"), cache_dir=tmp_path / "cache", cache_bytes=bound) as store:
        def reader(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(150):
                    a = int(rng.integers(0, 19_000))
                    b = a + int(rng.integers(1, 1025))
                    assert np.array_equal(store.read(a, b), tokens[a:b])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors[0]


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("damage", ["missing", "truncated", "corrupt"])
def test_a_bad_shard_is_one_error_naming_it(base, tmp_path, damage):
    tokens = stream(3000)
    manifest = write_dataset(base, {"train": tokens}, shard_tokens=1000, block_bytes=256)
    fs, root = fsspec.core.url_to_fs(base)
    path, expected = f"{root}/train/shard-00001.bin", manifest.splits["train"].shards[1].bytes
    data = fs.cat_file(path)
    if damage == "missing":
        fs.rm(path)
    elif damage == "truncated":
        fs.pipe_file(path, data[:500])
    else:
        fs.pipe_file(path, data[:600] + bytes([data[600] ^ 1]) + data[601:])
    what = {"missing": "missing", "truncated": f"500 bytes, expected {expected}", "corrupt": "checksum mismatch"}[damage]
    for read in ("ranged", "whole"):
        with open_store(base, cache_dir=tmp_path / read, prefetch_shards=0) as store:
            assert np.array_equal(store.read(0, 1000), tokens[:1000])
            with pytest.raises(DataError) as e:
                if read == "whole":
                    store.fetch(1)
                store.read(1100, 1300)  # the damage is in these bytes
            assert f"{base}/train/shard-00001.bin" in one_line(e) and what in str(e.value)
            with pytest.raises(DataError):
                store.read(1000, 1010)  # refused from then on, never garbage


@pytest.mark.integration
def test_a_damaged_cached_file_is_downloaded_again_and_a_killed_download_is_not_trusted(tmp_path):
    tokens = stream(2000)
    write_dataset(str(tmp_path / "d"), {"train": tokens}, shard_tokens=1000)
    with open_store(str(tmp_path / "d"), cache_dir=tmp_path / "cache", prefetch_shards=0) as store:
        cached = store.fetch(0)
        cache_dir = store.cache_dir
    raw = bytearray(cached.read_bytes())
    raw[100] ^= 0xFF
    cached.write_bytes(bytes(raw))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    part = cache_dir / f".train__shard-00001.bin.{int(dead.stdout)}.1.part"
    part.write_bytes(b"half a shard")
    with open_store(str(tmp_path / "d"), cache_dir=tmp_path / "cache", prefetch_shards=0) as store:
        assert not part.exists()
        assert np.array_equal(store.read(0, 2000), tokens)
        store.fetch(0)
    assert cached.read_bytes() != bytes(raw)  # replaced by a good copy


@pytest.mark.unit
def test_vocabulary_mismatch_and_missing_dataset_are_refused(tmp_path):
    write_dataset(str(tmp_path / "d"), {"train": stream(10)}, shard_tokens=10)
    with pytest.raises(DataError, match="vocab_size is 1000, not the 50257"):
        open_store(str(tmp_path / "d"), vocab_size=50257, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="no split 'eval'"):
        open_store(str(tmp_path / "d"), "eval", cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="diloco-data prepare"):
        open_store(str(tmp_path / "nothing"), cache_dir=tmp_path / "c")


# ---- MDS


def mds_samples(n: int, seed: int) -> list[np.ndarray]:
    """What tests/data/make_mds.py wrote with the real MDSWriter."""
    return [np.arange((i * 7 + seed) % 13 + 1) + 100 * i + seed for i in range(n)]


@pytest.mark.unit
@pytest.mark.parametrize("name,split,expected", [
    ("mds-int32-zstd", "train", mds_samples(40, 0)),
    ("mds-uint16-fixed", "train", list(np.arange(16 * 30).reshape(30, 16))),
    ("mds-splits", "train", mds_samples(12, 1)),
    ("mds-splits", "eval", mds_samples(12, 2)),
])
def test_mds_written_by_mdswriter(tmp_path, name, split, expected):
    with open_store(str(DATA / name), split, cache_dir=tmp_path / "cache", vocab_size=70000) as store:
        assert store.vocab_size == 70000 and store.total == sum(len(e) for e in expected)
        assert np.array_equal(store.read(0, store.total), np.concatenate(expected))
        assert np.array_equal(store.read(7, 60), np.concatenate(expected)[7:60])
    with open_store(str(DATA / name), split, cache_dir=tmp_path / "cache", eos_id=9999, mds_append_eos=True) as store:
        assert np.array_equal(store.read(0, store.total), np.concatenate([np.append(e, 9999) for e in expected]))


@pytest.mark.integration
def test_mds_on_s3_and_its_damage_named(s3, tmp_path):
    fs = fsspec.filesystem("s3")
    fs.put(str(DATA / "mds-int32-zstd"), "diloco-test/mds", recursive=True)
    expected = np.concatenate(mds_samples(40, 0))
    with open_store(f"{s3}/mds", cache_dir=tmp_path / "cache", prefetch_shards=1) as store:
        assert np.array_equal(store.read(0, store.total), expected)
    fs.pipe_file("diloco-test/mds/shard.00001.mds.zstd", b"\0" * 10)
    with pytest.raises(DataError, match=r"s3://diloco-test/mds/shard\.00001\.mds\.zstd: 10 bytes, expected"):
        with open_store(f"{s3}/mds", cache_dir=tmp_path / "other", prefetch_shards=0) as store:  # counts tokens
            store.read(0, store.total)


def write_mds(out: Path, rows: list[np.ndarray], encoding: str, per_shard: int, compress: bool) -> None:
    """An MDS dataset per the documented format, one ndarray column "tokens" and a str column "text"."""
    out.mkdir(parents=True)
    names, encodings = ["text", "tokens"], ["str", encoding]
    shards = []
    for k, at in enumerate(range(0, len(rows), per_shard)):
        samples = []
        for i, row in enumerate(rows[at:at + per_shard]):
            text = f"sample {at + i}".encode()
            body = b"" if encoding.count(":") >= 1 else bytes([{np.dtype('int32'): 33, np.dtype('uint16'): 16}[row.dtype]])
            body += bytes([(1 << 2) | 1]) + np.array([len(row)], np.uint16).tobytes() + row.tobytes()
            samples.append(np.array([len(text), len(body)], np.uint32).tobytes() + text + body)
        config = json.dumps({"column_names": names}).encode()
        offsets = np.cumsum([0] + [len(s) for s in samples]).astype(np.uint32) + 4 + 4 * (len(samples) + 1) + len(config)
        raw = np.uint32(len(samples)).tobytes() + offsets.tobytes() + config + b"".join(samples)
        base = f"shard.{k:05d}.mds"
        entry = {"format": "mds", "version": 2, "column_names": names, "column_encodings": encodings,
                 "column_sizes": [None, None], "compression": "zstd" if compress else None, "hashes": [],
                 "samples": len(samples), "size_limit": None, "raw_data": {"basename": base, "bytes": len(raw), "hashes": {}},
                 "zip_data": None}
        if compress:
            zipped = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
            entry["zip_data"] = {"basename": base + ".zstd", "bytes": len(zipped), "hashes": {}}
            (out / (base + ".zstd")).write_bytes(zipped)
        else:
            (out / base).write_bytes(raw)
        shards.append(entry)
    (out / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))


@pytest.mark.unit
@pytest.mark.parametrize("encoding,compress", [("ndarray:int32", True), ("ndarray", False), ("ndarray:uint16", False)])
def test_mds_per_documented_format(tmp_path, encoding, compress):
    dtype = np.uint16 if "uint16" in encoding else np.int32
    rows = [np.arange(i % 5 + 1, dtype=dtype) * (i + 1) for i in range(23)]
    write_mds(tmp_path / "mds", rows, encoding, per_shard=5, compress=compress)
    with open_store(str(tmp_path / "mds"), cache_dir=tmp_path / "cache", cache_bytes=1, prefetch_shards=1) as store:
        assert np.array_equal(store.read(0, store.total), np.concatenate(rows))
        assert (tmp_path / "cache").glob("*/mds-counts.json")  # dynamic shapes: counted once
    with open_store(str(tmp_path / "mds"), cache_dir=tmp_path / "cache") as store:
        assert np.array_equal(store.read(3, 40), np.concatenate(rows)[3:40])
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(DataError, match="no token column 'ids'"):
        open_store(str(tmp_path / "mds"), cache_dir=tmp_path / "cache", column="ids")
