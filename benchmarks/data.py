"""Token data benchmark: prepare throughput, and ShardStore read throughput from local disk and S3.

1. Prepare. `diloco-data prepare` on the wikitext-2 text in ../shared/data (valid + test, about
   2.5 MB): once training a byte-level BPE (--vocab-size), then again with that tokenizer given,
   which times tokenizing and writing alone. Figures are tokens/s of wall time with --workers
   (default: every core).
2. Reads. A training loop's reads through ShardStore from one thread: batches of 8 windows of
   1025 tokens read one after another through the split, from a dataset on local disk and on a
   local moto S3 server, with the cache cold (a fresh cache directory: reads start as ranged
   reads while whole shards download) and warm (every shard cached). "first read" is the
   latency of the very first window of a fresh store. The target: twice the 457,671 tokens/s
   a 125M island consumes on one H100, from one core with the cache warm; a cold first read
   under 1 s.
3. The island's loader: what an island's feed does each inner step (islands/feed.py): a batch of
   --batch windows of 1024 + 1 tokens at consecutive stream positions (a lease), read through
   WindowSamples's shuffled epoch order (diloco/data/samples.py) into an int64 tensor, for
   --loader-steps steps. "first step" is the wait from opening the corpus with an empty cache to
   the first batch in hand (what a cold start adds to the first step); then steps/s and tokens/s.

Run from the repository root:  python -m benchmarks.data   (about half a minute on 2 cores)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from diloco.data.prepare import PrepareConfig, prepare
from diloco.data.shards import open_store

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA = REPO_ROOT.parent / "shared" / "data"
TARGET = 2 * 457_671


def bench_prepare(workdir: Path, inputs: list[str], vocab_size: int, workers: int, shard_tokens: int) -> str:
    t = time.perf_counter()
    manifest = prepare(PrepareConfig(inputs, str(workdir / "trained"), vocab_size=vocab_size,
                                     shard_tokens=shard_tokens, workers=workers))
    trained_s = time.perf_counter() - t
    tokens = sum(s.tokens for s in manifest.splits.values())
    t = time.perf_counter()
    prepare(PrepareConfig(inputs, str(workdir / "given"), tokenizer=str(workdir / "trained" / "tokenizer.json"),
                          shard_tokens=shard_tokens, workers=workers))
    given_s = time.perf_counter() - t
    print(f"prepare ({workers} workers, {tokens:,} tokens, vocab {vocab_size}): "
          f"training the BPE too {tokens / trained_s:,.0f} tokens/s ({trained_s:.2f} s); "
          f"tokenizer given {tokens / given_s:,.0f} tokens/s ({given_s:.2f} s)")
    return str(workdir / "given")


def bench_reads(url: str, label: str, cache: Path, seq: int = 1025, batch: int = 8) -> None:
    for state in ("cold", "warm"):
        if state == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        store = open_store(url, cache_dir=cache, prefetch_shards=2)
        store.read(0, seq)
        first = time.perf_counter() - t
        n, pos = 0, 0
        t = time.perf_counter()
        while pos + batch * seq <= store.total:
            for _ in range(batch):
                n += len(store.read(pos, pos + seq))
                pos += seq
        elapsed = time.perf_counter() - t
        if state == "cold":
            for i in range(len(store.shards)):
                store.fetch(i)  # warm for the next pass
        store.close()
        verdict = "" if state == "cold" else f" ({'meets' if n / elapsed >= TARGET else 'misses'} the {TARGET:,} target)"
        print(f"reads {label:5s} {state}: first read {first * 1000:.1f} ms, {n / elapsed:,.0f} tokens/s{verdict}")


def bench_loader(url: str, label: str, cache: Path, batch: int, steps: int, seq_len: int = 1024) -> None:
    from diloco.data.samples import WindowSamples

    for state in ("cold", "warm"):
        if state == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        samples = WindowSamples(open_store(url, cache_dir=cache, prefetch_shards=2), seq_len, seed=0)
        samples.prefetch(0, steps * batch)  # the island prefetches each lease as it gets it
        first = samples.sequences(0, batch)
        first_s = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(1, steps + 1):
            seqs = samples.sequences(step * batch, batch)
            inputs, targets = seqs[:, :-1], seqs[:, 1:]
        elapsed = time.perf_counter() - t
        assert inputs.shape == targets.shape == first[:, :-1].shape
        samples.store.close()
        tokens = steps * batch * seq_len
        print(f"loader {label:5s} {state}: first step {first_s * 1000:.1f} ms, {steps / elapsed:,.1f} steps/s of "
              f"{batch} x {seq_len}, {tokens / elapsed:,.0f} tokens/s "
              f"({tokens / elapsed / TARGET * 2:.0f}x the 457,671 an H100 consumes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shard-tokens", type=int, default=1 << 18, help="small, so the reads cross shards")
    p.add_argument("--batch", type=int, default=32, help="loader: windows a step (the 125M preset's batch)")
    p.add_argument("--loader-steps", type=int, default=200, help="loader: steps timed")
    args = p.parse_args()
    inputs = [str(DATA / n) for n in ("wikitext2-valid.txt", "wikitext2-test.txt")]
    missing = [i for i in inputs if not Path(i).exists()]
    if missing:
        raise SystemExit(f"benchmarks/data.py: {missing[0]} is missing (the shared data folder beside the repository)")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        local = bench_prepare(work, inputs, args.vocab_size, args.workers, args.shard_tokens)
        bench_reads(local, "local", work / "cache-local")
        bench_loader(local, "local", work / "loader-local", args.batch, args.loader_steps)
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            import logging

            import fsspec

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            host, port = server.get_host_and_port()
            os.environ.update({"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
            fs = fsspec.filesystem("s3")
            fs.mkdir("bench")
            fs.put(local, "bench/data", recursive=True)
            bench_reads("s3://bench/data", "s3", work / "cache-s3")
            bench_loader("s3://bench/data", "s3", work / "loader-s3", args.batch, args.loader_steps)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
