"""Training data: an embedded synthetic language, a byte-level text loader, and token corpora.

The first two are endless: each island reads a disjoint shard, a batch a pure
function of shard, slot and inner step. A token corpus (diloco/data/shards.py, read
as numbered samples by diloco/data/samples.py) is finite, and the coordinator leases
its samples to islands (coordinator/ledger.py). Every source gives the
coordinator a fixed held-out set for evaluating the global parameters.

The synthetic language is an order-k Markov chain over a small vocabulary in
which every context allows a few next tokens with Dirichlet-drawn weights. Its
entropy rate is computed exactly, so a run can say how close its loss gets to
the best any model can do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from diloco.config import ConfigError, DataConfig
from diloco.data.samples import WindowSamples, eval_windows

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), int64 (batch, seq)


class TokenStream(Protocol):
    def next_batch(self, batch_size: int) -> Batch: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --- synthetic language -------------------------------------------------------


@dataclass(frozen=True)
class MarkovLanguage:
    vocab: int
    order: int
    support: np.ndarray  # (contexts, branching) allowed next tokens
    cumprobs: np.ndarray  # (contexts, branching) cumulative next-token probabilities
    stationary: np.ndarray  # (contexts,) stationary distribution over contexts

    @staticmethod
    def build(vocab: int, order: int, branching: int, seed: int) -> "MarkovLanguage":
        if not (1 <= branching <= vocab) or order < 1:
            raise ConfigError("synthetic language needs 1 <= branching <= vocab and order >= 1")
        contexts = vocab**order
        if contexts > 1 << 20:
            raise ConfigError(f"synthetic language with vocab**order = {contexts} contexts is too large")
        rng = np.random.default_rng(seed)
        # Each context draws its next tokens from a pool fixed by its last token,
        # so the language has learnable bigram structure that the full context
        # then sharpens: loss falls in stages rather than off a cliff.
        pool_size = min(vocab, 2 * branching)
        pools = np.argsort(rng.random((vocab, vocab)), axis=1)[:, :pool_size]
        pick = np.argsort(rng.random((contexts, pool_size)), axis=1)[:, :branching]
        support = np.take_along_axis(pools[np.arange(contexts) % vocab], pick, axis=1)
        probs = rng.dirichlet(np.ones(branching), size=contexts)
        cumprobs = np.cumsum(probs, axis=1)
        cumprobs[:, -1] = 1.0
        # Stationary distribution over contexts by power iteration on the
        # lifted chain (ctx -> ctx' = (ctx * vocab + next) mod contexts).
        nxt = (np.arange(contexts)[:, None] * vocab + support) % contexts
        pi = np.full(contexts, 1.0 / contexts)
        for _ in range(5000):
            new = np.zeros(contexts)
            np.add.at(new, nxt.ravel(), (pi[:, None] * probs).ravel())
            new = 0.5 * (new + pi)  # lazy chain: converges even if periodic
            done = np.abs(new - pi).sum() < 1e-12
            pi = new
            if done:
                break
        return MarkovLanguage(vocab, order, support, cumprobs, pi / pi.sum())

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: sum over contexts of pi(c) * H(next | c)."""
        probs = np.diff(self.cumprobs, axis=1, prepend=0.0)
        h = -(probs * np.log(np.clip(probs, 1e-300, None))).sum(axis=1)
        return float((self.stationary * h).sum())

    def sample(self, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
        contexts = len(self.stationary)
        ctx = rng.choice(contexts, size=batch, p=self.stationary)
        # Spell out the starting context so the first tokens are consistent with it.
        digits = [(ctx // self.vocab**i) % self.vocab for i in reversed(range(self.order))]
        out = np.empty((batch, length), dtype=np.int64)
        for t in range(length):
            if t < self.order:
                out[:, t] = digits[t]
                continue
            u = rng.random(batch)[:, None]
            choice = (self.cumprobs[ctx] < u).sum(axis=1)
            tok = self.support[ctx, np.minimum(choice, self.support.shape[1] - 1)]
            out[:, t] = tok
            ctx = (ctx * self.vocab + tok) % contexts
        return out


class SyntheticStream:
    """Endless samples of the Markov language; each shard has its own RNG stream."""

    def __init__(self, language: MarkovLanguage, seq_len: int, seed: int, shard: int):
        self.language = language
        self.seq_len = seq_len
        self.rng = np.random.default_rng([seed, shard, 0x5EED])

    def next_batch(self, batch_size: int) -> Batch:
        seqs = torch.from_numpy(self.language.sample(self.rng, batch_size, self.seq_len + 1))
        return seqs[:, :-1], seqs[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


# --- byte-level text ----------------------------------------------------------


def read_bytes(path: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file not found: {p} (set data.path to a text file)")
    data = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    if len(data) < 4096:
        raise ConfigError(f"data file {p} is too small ({len(data)} bytes)")
    return data


def split_text(data: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(data) * (1.0 - eval_fraction))
    return data[:cut], data[cut:]


class TextShardStream:
    """Random windows from one disjoint shard of a byte string.

    With stripe_bytes > 0 the text is cut into stripes and shard s takes every
    num_shards-th stripe, starting at s: shards are disjoint and each is a
    sample of the whole text (i.i.d. shards, as a globally shuffled corpus
    split across islands would be). Windows never cross a stripe boundary.
    With stripe_bytes = 0 each shard is one contiguous block (non-i.i.d.: a
    harder setting where islands see different parts of the text).
    """

    def __init__(self, train: np.ndarray, seq_len: int, seed: int, shard: int, num_shards: int, stripe_bytes: int = 0):
        window = seq_len + 1
        stripe = len(train) // num_shards if stripe_bytes <= 0 else max(stripe_bytes, 2 * window)
        n_stripes = len(train) // stripe
        mine = np.arange(shard, n_stripes - n_stripes % num_shards, num_shards)
        if stripe < 2 * window or len(mine) == 0:
            raise ConfigError(
                f"text too small for {num_shards} shards of seq_len {seq_len} "
                f"({len(train)} training bytes, stripes of {stripe}); use fewer shards or a shorter seq_len"
            )
        stripes = train[: n_stripes * stripe].reshape(n_stripes, stripe)[mine]
        self.tokens = torch.from_numpy(stripes.astype(np.int64))  # (stripes, stripe)
        self.seq_len = seq_len
        self.rng = np.random.default_rng([seed, shard, 0x7E47])

    def next_batch(self, batch_size: int) -> Batch:
        rows = self.rng.integers(0, self.tokens.shape[0], size=batch_size)
        starts = self.rng.integers(0, self.tokens.shape[1] - self.seq_len, size=batch_size)
        columns = torch.from_numpy(starts[:, None] + np.arange(self.seq_len + 1))
        seqs = self.tokens[torch.from_numpy(rows)[:, None], columns]
        return seqs[:, :-1], seqs[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


# --- entry points -------------------------------------------------------------


def _language(cfg: DataConfig) -> MarkovLanguage:
    return MarkovLanguage.build(cfg.synthetic_vocab, cfg.synthetic_order, cfg.synthetic_branching, cfg.synthetic_seed)


def train_stream(cfg: DataConfig, seed: int, shard: int, num_shards: int) -> TokenStream:
    """The stream island `shard` of `num_shards` trains on."""
    if not 0 <= shard < num_shards:
        raise ConfigError(f"shard {shard} out of range for {num_shards} shards")
    if cfg.source == "synthetic":
        return SyntheticStream(_language(cfg), cfg.seq_len, seed, shard)
    train, _ = split_text(read_bytes(cfg.path), cfg.eval_fraction)
    return TextShardStream(train, cfg.seq_len, seed, shard, num_shards, cfg.stripe_bytes)


class StepIndexedStream:
    """The batch of inner step s is a pure function of (seed, shard, s).

    For ranks of replica groups: the data position is just the inner step, so
    a group healed from a peer at step s reads exactly what it would have, a
    step redone after a failed commit reads the same batch again, and the
    batches a dead group would have read are skipped, never read twice.
    """

    def __init__(self, cfg: DataConfig, seed: int, shard: int, num_shards: int):
        self.stream = train_stream(cfg, seed, shard, num_shards)
        self.seed, self.shard = seed, shard

    def batch_at(self, step: int, batch_size: int) -> Batch:
        self.stream.rng = np.random.default_rng([self.seed, self.shard, step, 0x57E9])
        return self.stream.next_batch(batch_size)


# --- a token corpus -------------------------------------------------------------


@dataclass
class Corpus:
    """One split of a token corpus as numbered samples, and what identifies the data."""

    samples: WindowSamples
    digest: str  # of its manifest (or MDS index): islands refuse to train on other data than the coordinator's
    vocab_size: int


def open_store(cfg: DataConfig, split: str, vocab_size: int | None = None):
    """One split of the corpus at cfg.url. vocab_size: the model's, checked against the corpus's (an MDS
    dataset, which does not say, takes it)."""
    from diloco.data.shards import DataError, open_store as open_split

    try:
        store = open_split(cfg.url, split, cfg.cache_dir or None, int(cfg.cache_gb * (1 << 30)), cfg.prefetch_shards)
    except DataError:
        raise
    except Exception as e:  # the storage's own errors (no credentials, no such bucket, unreachable)
        raise ConfigError(f"cannot open the token corpus at {cfg.url} ({type(e).__name__}: {e}); check data.url "
                          "and the storage's credentials (for s3://, AWS_* variables or ~/.aws)") from e
    if store.vocab_size is None:
        if not vocab_size:
            raise ConfigError(f"the MDS dataset at {cfg.url} does not say its vocabulary size: set model.vocab_size")
        store.vocab_size = vocab_size
    if vocab_size and store.vocab_size != vocab_size:
        raise ConfigError(f"the corpus at {cfg.url} has a vocabulary of {store.vocab_size}, the model {vocab_size}: "
                          f"set model.vocab_size = {store.vocab_size} (or 0 to take it from the corpus)")
    return store


def open_corpus(cfg: DataConfig, seed: int, vocab_size: int | None = None, split: str = "train") -> Corpus:
    """The corpus at cfg.url; vocab_size is the model's (None or 0: take the corpus's, which an MDS dataset lacks)."""
    store = open_store(cfg, split, vocab_size)
    return Corpus(WindowSamples(store, cfg.seq_len, seed, cfg.shuffle_block), corpus_digest(cfg.url, split), store.vocab_size)


def corpus_digest(url: str, split: str = "train") -> str:
    """SHA-256 (16 hex digits) of what defines the corpus: its manifest, or an MDS dataset's index."""
    import hashlib

    import fsspec

    from diloco.data.mds import find_mds_index
    from diloco.data.shards import MANIFEST

    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    root = root.rstrip("/")
    path = f"{root}/{MANIFEST}" if fs.exists(f"{root}/{MANIFEST}") else find_mds_index(fs, root, split)
    return hashlib.sha256(fs.cat_file(path)).hexdigest()[:16]


def eval_batches(cfg: DataConfig, n_batches: int, batch_size: int, vocab_size: int | None = None) -> list[Batch]:
    """A fixed held-out set: the same batches every time it is built."""
    if cfg.source == "tokens":
        store = open_store(cfg, "eval", vocab_size)
        seqs = eval_windows(store, cfg.seq_len, n_batches * batch_size)
        store.close()
        return [(b[:, :-1], b[:, 1:]) for b in seqs.split(batch_size)]
    if cfg.source == "synthetic":
        stream = SyntheticStream(_language(cfg), cfg.seq_len, seed=0xE7A1, shard=0)
        return [stream.next_batch(batch_size) for _ in range(n_batches)]
    _, held_out = split_text(read_bytes(cfg.path), cfg.eval_fraction)
    tokens = torch.from_numpy(held_out.astype(np.int64))
    n = n_batches * batch_size
    span = len(tokens) - cfg.seq_len - 1
    starts = np.linspace(0, span, num=n, dtype=np.int64)
    seqs = torch.stack([tokens[s : s + cfg.seq_len + 1] for s in starts.tolist()])
    return [(b[:, :-1], b[:, 1:]) for b in seqs.split(batch_size)]


def entropy_floor(cfg: DataConfig) -> float | None:
    """The lowest achievable loss in nats/token, where it is known."""
    return _language(cfg).entropy_rate() if cfg.source == "synthetic" else None


def resolve_vocab(cfg) -> None:
    """A run on a token corpus takes its vocabulary size from the corpus (model.vocab_size = 0), or checks it."""
    if cfg.data.source == "tokens":
        cfg.model.vocab_size = open_corpus(cfg.data, cfg.seed, cfg.model.vocab_size).vocab_size


# --- held-out text for a model with a tokenizer (diloco-eval --text) ----------------------------------------


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def text_eval_batches(data: DataConfig, tokenizer: Encoder, n_batches: int, batch_size: int) -> list[Batch]:
    """eval_batches of a text file for a model with a tokenizer: the same held-out tail
    (the bytes past the cut a byte-level run on data.path makes at data.eval_fraction), decoded and
    encoded whole with tokenizer, then cut into the same evenly spaced windows of data.seq_len + 1."""
    _, tail = split_text(read_bytes(data.path), data.eval_fraction)
    tokens = tokenizer.encode(_utf8(tail.tobytes(), data.path))
    return token_windows(tokens, data.seq_len, n_batches, batch_size, f"the held-out tail of {data.path}")


def _utf8(data: bytes, where: str) -> str:
    # The byte cut can fall inside a character: its continuation bytes (10xxxxxx, at most 3) are dropped.
    skip = next((i for i, b in enumerate(data[:3]) if b & 0xC0 != 0x80), min(3, len(data)))
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def token_windows(tokens: Sequence[int], seq_len: int, n_batches: int, batch_size: int, where: str) -> list[Batch]:
    """n_batches (inputs, targets) of batch_size windows of seq_len + 1 tokens spread evenly over tokens,
    as eval_batches spreads them over a text's bytes (overlapping where there are few)."""
    ids = torch.tensor(list(tokens), dtype=torch.long)
    span = len(ids) - seq_len - 1
    if span < 0:
        raise ValueError(f"{where} is {len(ids)} tokens, fewer than one window of {seq_len + 1}: give more text, "
                        "a larger data.eval_fraction (--set) or a smaller --seq-len")
    starts = np.linspace(0, span, num=n_batches * batch_size, dtype=np.int64)
    seqs = torch.stack([ids[s : s + seq_len + 1] for s in starts.tolist()])
    return [(b[:, :-1], b[:, 1:]) for b in seqs.split(batch_size)]
