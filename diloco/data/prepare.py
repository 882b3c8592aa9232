"""`diloco-data prepare`: text in, token shards and a manifest out (the format: diloco/data/shards.py).

Deterministic: the token stream is the documents' tokens in input order, whatever the number of
workers (batches are tokenized in parallel and taken back in order), and cut into shards of
exactly `shard_tokens` (the last one shorter); the same inputs and flags give byte-identical
shards and manifest.

Resumable: `prepare-state.json` at the output records the arguments' digest, the shards
written, the input position after the last batch they hold, and the tokens of that batch and
earlier that are not in a shard yet (in `prepare-pending-N.bin`). Rerunning the same command
continues from there; other arguments at an output that is not empty are refused. Every file
appears whole or not at all (local: a temporary name, then a rename; object stores: an object
exists once its upload completes), and manifest.json is written last.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
from collections import deque
from dataclasses import asdict, dataclass, field

import fsspec
import numpy as np
import xxhash

from diloco.data import bpe
from diloco.data.corpus import Position, batches, documents, is_eval, list_inputs
from diloco.progress import Progress
from diloco.data.shards import BLOCK_BYTES, MANIFEST, TOKENIZER, Manifest, ShardInfo, SplitInfo, encode_shard, token_dtype

log = logging.getLogger(__name__)

STATE = "prepare-state.json"
STATE_VERSION = 1
KILL_AT_SHARD = "DILOCO_PREPARE_KILL_AT_SHARD"  # tests: SIGKILL while writing the Nth shard of a run


class PrepareError(ValueError):
    """A prepare that cannot run as asked; the message says what to change."""


@dataclass
class PrepareConfig:
    inputs: list[str]
    output: str
    tokenizer: str | None = None  # a tokenizer.json (path or URL); None: train one
    vocab_size: int | None = None  # for a trained tokenizer
    eos_token: str = "<|endoftext|>"
    text_field: str = "text"
    text_docs: str = "blank"
    eval_fraction: float = 0.005
    shard_tokens: int = 1 << 24
    block_bytes: int = BLOCK_BYTES
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    progress: bool = False
    storage_options: dict | None = None


class Output:
    """The output URL: whole files only, written atomically."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = "file" in self.fs.protocol

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def write(self, rel: str, data: bytes) -> None:
        if self.local:
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{self.path(rel)}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(rel))
        else:
            self.fs.pipe_file(self.path(rel), data)  # one PUT (or a multipart upload completed at the end)

    def read(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            return None

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel))
        except FileNotFoundError:
            pass

    def remove_temporaries(self) -> None:
        """Removes what a killed run was writing (local only: an object store shows no partial object)."""
        if self.local:
            for path in self.fs.find(self.root):
                if ".tmp-" in path.rsplit("/", 1)[-1]:
                    self.fs.rm(path)

    def empty(self) -> bool:
        try:
            return not self.fs.find(self.root)
        except FileNotFoundError:
            return True


class SplitWriter:
    """One split's shards: tokens in, whole shards out, the rest pending until the next shard fills."""

    def __init__(self, out: Output, split: str, cfg: PrepareConfig, dtype: np.dtype, state: dict | None,
                 pending: np.ndarray, kill_at: int | None):
        self.out, self.split, self.cfg, self.dtype, self.kill_at = out, split, cfg, dtype, kill_at
        self.shards = [ShardInfo.from_dict(s) for s in state["shards"]] if state else []
        self.documents = state["documents"] if state else 0
        self.pending = [pending]
        self.pending_tokens = len(pending)
        self.written = 0  # shards written by this run

    def add(self, tokens: np.ndarray, documents: int) -> None:
        self.documents += documents
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        if self.pending_tokens >= self.cfg.shard_tokens:
            stream = np.concatenate(self.pending)
            n = self.cfg.shard_tokens
            full = len(stream) // n
            for k in range(full):
                self._write(stream[k * n:(k + 1) * n])
            self.pending = [stream[full * n:]]
            self.pending_tokens = len(self.pending[0])

    def finish(self) -> None:
        if self.pending_tokens:
            self._write(np.concatenate(self.pending))
            self.pending, self.pending_tokens = [], 0

    def pending_array(self) -> np.ndarray:
        return np.concatenate(self.pending).astype(np.uint32) if self.pending else np.zeros(0, np.uint32)

    def info(self) -> SplitInfo:
        return SplitInfo(tuple(self.shards), self.documents)

    def _write(self, tokens: np.ndarray) -> None:
        rel = f"{self.split}/shard-{len(self.shards):05d}.bin"
        data = encode_shard(tokens, self.dtype)
        if self.kill_at is not None and self.written + 1 >= self.kill_at and self.out.local:
            with open(f"{self.out.path(rel)}.tmp-{os.getpid()}", "wb") as f:  # as a kill mid-write leaves it
                f.write(data[:len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        self.out.write(rel, data)
        self.shards.append(ShardInfo.of(rel, data, len(tokens), self.cfg.block_bytes))
        self.written += 1


def args_digest(cfg: PrepareConfig, inputs, tokenizer_sha: str | None) -> str:
    """What the output depends on (not the number of workers, nor where it is written)."""
    what = {"version": STATE_VERSION, "inputs": [(f.url, f.size) for f in inputs],
            "tokenizer": tokenizer_sha or {"train": cfg.vocab_size}, "eos_token": cfg.eos_token,
            "text_field": cfg.text_field, "text_docs": cfg.text_docs, "eval_fraction": cfg.eval_fraction,
            "shard_tokens": cfg.shard_tokens, "block_bytes": cfg.block_bytes}
    return bpe.sha256(json.dumps(what, sort_keys=True).encode())


def prepare(cfg: PrepareConfig) -> Manifest:
    """Tokenizes cfg.inputs into shards and a manifest at cfg.output, resuming a killed run of the same."""
    if cfg.text_docs not in ("blank", "line", "file"):
        raise PrepareError(f"text documents are cut by blank, line or file, not {cfg.text_docs!r}")
    if not 0 <= cfg.eval_fraction < 1 or cfg.shard_tokens < 1 or cfg.workers < 1:
        raise PrepareError("needs 0 <= eval_fraction < 1, shard_tokens >= 1 and workers >= 1")
    if (cfg.tokenizer is None) == (cfg.vocab_size is None):
        raise PrepareError("give a tokenizer (--tokenizer tokenizer.json) or train one (--train-tokenizer --vocab-size N)")
    inputs = list_inputs(cfg.inputs, cfg.storage_options)
    given = None
    if cfg.tokenizer is not None:
        try:
            with fsspec.open(cfg.tokenizer, "rb", **(cfg.storage_options or {})) as f:
                given = f.read()
        except FileNotFoundError:
            raise PrepareError(f"tokenizer {cfg.tokenizer} does not exist") from None
        bpe.describe(given.decode(), cfg.eos_token, cfg.tokenizer)
    digest = args_digest(cfg, inputs, bpe.sha256(given) if given else None)
    out = Output(cfg.output, cfg.storage_options)
    raw_state = out.read(STATE)
    state = json.loads(raw_state) if raw_state else None
    if state is None and not out.empty():
        raise PrepareError(f"output {out.url} is not empty and holds no {STATE}: give an empty or new output")
    if state is not None and state.get("args_digest") != digest:
        raise PrepareError(f"output {out.url} was prepared with other inputs or flags: rerun with the same "
                           "ones to resume, or give an empty or new output")
    if state is not None and state.get("complete") and out.read(MANIFEST):
        log.info("%s is already complete", out.url)
        return Manifest.from_json(out.read(MANIFEST).decode(), f"{out.url}/{MANIFEST}")
    if state is None or state.get("tokenizer_sha256") is None:
        state = {"version": STATE_VERSION, "args_digest": digest, "tokenizer_sha256": None, "complete": False}
        out.write(STATE, _json(state))  # claims the output before anything else appears in it
        tokenizer = given if given is not None else _train(cfg, inputs).encode()
        out.write(TOKENIZER, tokenizer)
        state["tokenizer_sha256"] = bpe.sha256(tokenizer)
        out.write(STATE, _json(state))
    tokenizer = out.read(TOKENIZER)
    if tokenizer is None or bpe.sha256(tokenizer) != state["tokenizer_sha256"]:
        raise PrepareError(f"{out.url}/{TOKENIZER} changed since this prepare began: give an empty or new output")
    vocab_size, eos_id = bpe.describe(tokenizer.decode(), cfg.eos_token, f"{out.url}/{TOKENIZER}")
    manifest = _tokenize(cfg, inputs, out, state, tokenizer.decode(), vocab_size, eos_id)
    out.write(MANIFEST, manifest.to_json().encode())
    for name in state.get("pending_files", []):
        out.remove(name)
    out.remove_temporaries()
    out.write(STATE, _json({**state, "complete": True, "pending_files": []}))
    return manifest


def _json(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1).encode()


def _train(cfg: PrepareConfig, inputs) -> str:
    """A BPE trained on the training split's documents (held-out ones excluded)."""
    def texts():
        for f in inputs:
            for text in documents(f.url, cfg.text_field, cfg.text_docs, cfg.storage_options):
                if not is_eval(text, cfg.eval_fraction):
                    yield text

    if cfg.progress:
        print(f"prepare: training a {cfg.vocab_size}-token BPE on {len(inputs)} file(s)", file=sys.stderr)
    return bpe.train_bpe(texts(), cfg.vocab_size, cfg.eos_token)


def _tokenize(cfg: PrepareConfig, inputs, out: Output, state: dict, tokenizer: str, vocab_size: int,
              eos_id: int) -> Manifest:
    dtype = token_dtype(vocab_size)
    pending = np.zeros(0, np.uint32)
    if state.get("pending_file"):
        raw = out.read(state["pending_file"])
        if raw is None or xxhash.xxh3_128_hexdigest(raw) != state["pending_xxh3_128"]:
            raise PrepareError(f"{out.url}/{state['pending_file']} is missing or damaged: give an empty or new output")
        pending = np.frombuffer(raw, "<u4")
    kill_at = int(os.environ[KILL_AT_SHARD]) if os.environ.get(KILL_AT_SHARD) else None
    splits = state.get("splits", {})
    n_train = splits.get("train", {}).get("pending", 0)
    writers = {"train": SplitWriter(out, "train", cfg, dtype, splits.get("train"), pending[:n_train], kill_at),
               "eval": SplitWriter(out, "eval", cfg, dtype, splits.get("eval"), pending[n_train:], kill_at)}
    position = Position(**state.get("position", {}))
    done = sum(w.info().tokens + w.pending_tokens for w in writers.values())
    progress = Progress("prepare", unit="tokens", force=cfg.progress, enabled=False, initial=done, interval_s=0.5)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizers threads have run
    with ctx.Pool(cfg.workers, initializer=bpe.start_worker, initargs=(tokenizer, eos_id, cfg.eval_fraction)) as pool:
        window: deque = deque()

        def take() -> None:
            batch, result = window.popleft()
            train, held, n_train_docs, n_eval_docs = result.get()
            before = sum(len(w.shards) for w in writers.values())
            writers["train"].add(train, n_train_docs)
            writers["eval"].add(held, n_eval_docs)
            progress.update(len(train) + len(held), f"{sum(w.documents for w in writers.values()):,} documents")
            if sum(len(w.shards) for w in writers.values()) > before:
                _checkpoint(out, state, writers, batch.end)

        for batch in batches(inputs, position, cfg.text_field, cfg.text_docs, cfg.storage_options):
            window.append((batch, pool.apply_async(bpe.tokenize_batch, (batch.docs,))))
            if len(window) >= 2 * cfg.workers:
                take()
        while window:
            take()
    for w in writers.values():
        w.finish()
    progress.close()
    return Manifest(tokenizer_sha256=state["tokenizer_sha256"], vocab_size=vocab_size, eos_id=eos_id,
                    eos_token=cfg.eos_token, block_bytes=cfg.block_bytes,
                    splits={name: w.info() for name, w in writers.items()})


def _checkpoint(out: Output, state: dict, writers: dict[str, SplitWriter], position: Position) -> None:
    """Records the shards written and what is pending after position: the pending tokens first, then the state."""
    pending = np.concatenate([w.pending_array() for w in writers.values()]).astype("<u4").tobytes()
    seq = state.get("checkpoints", 0) + 1
    name = f"prepare-pending-{seq:06d}.bin"
    out.write(name, pending)
    previous = state.get("pending_files", [])
    state.update({
        "checkpoints": seq, "position": asdict(position), "pending_file": name,
        "pending_xxh3_128": xxhash.xxh3_128_hexdigest(pending), "pending_files": [name],
        "splits": {n: {**w.info().to_dict(), "pending": w.pending_tokens} for n, w in writers.items()},
    })
    out.write(STATE, _json(state))
    for old in previous:
        if old != name:
            out.remove(old)
