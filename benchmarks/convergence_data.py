"""The convergence benchmark's training data: a byte-level text file's shards, or a token corpus.

Split from benchmarks/convergence.py (which runs the jobs) to keep each file short.

A token corpus (`data.source = "tokens"`, made by `diloco-data prepare`) is read
the way a real run's coordinator hands it out (coordinator/ledger.py): as
disjoint ranges of stream positions of `diloco.data.samples.WindowSamples`. Island m
of M reads its k-th batch of b samples from positions (k * M + m) * b ... + b,
so at inner step k the M islands together read positions k * M * b ... + M * b
and DDP, whose batch is the concatenation of the islands' batches, trains on
exactly the same samples. Positions past one epoch go on into the next epoch's
shuffled order, as a run's leases do.
"""

from __future__ import annotations

import logging
from pathlib import Path

from diloco.config import RunConfig
from diloco.data.sources import Batch, TokenStream, open_corpus, open_store, train_stream
from diloco.data.samples import WindowSamples

log = logging.getLogger("convergence")

REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_data(path: str) -> Path:
    """A relative local path is taken relative to the repository root, not the cwd."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def data_overrides(tokens: str | None, text: str) -> list[str]:
    """The RunConfig overrides naming what to train on: the token corpus at `tokens`, else the text file's bytes."""
    if tokens:
        return ["data.source='tokens'", f"data.url='{tokens if '://' in tokens else resolve_data(tokens)}'"]
    data = resolve_data(text)
    if not data.is_file():
        raise SystemExit(f"convergence: error: data file not found: {data}")
    return ["data.source='text'", f"data.path='{data}'"]


class LeasedStream:
    """Island `island` of `islands` on a token corpus: consecutive positions, interleaved by step."""

    def __init__(self, samples: WindowSamples, island: int, islands: int):
        self.samples, self.island, self.islands = samples, island, islands
        self.step = 0  # batches read so far

    def next_batch(self, batch_size: int) -> Batch:
        start = (self.step * self.islands + self.island) * batch_size
        self.step += 1
        seqs = self.samples.sequences(start, batch_size)
        return seqs[:, :-1], seqs[:, 1:]


def island_streams(cfg: RunConfig, islands: int, which: list[int] | None = None) -> list[TokenStream]:
    """The training streams of islands `which` (default all) of `islands`."""
    which = list(range(islands)) if which is None else which
    if cfg.data.source == "tokens":
        samples = open_corpus(cfg.data, cfg.seed, cfg.model.vocab_size).samples  # one store for all islands
        return [LeasedStream(samples, m, islands) for m in which]
    return [train_stream(cfg.data, cfg.seed, m, islands) for m in which]


def corpus_vocab(cfg: RunConfig) -> int:
    """The vocabulary size of the token corpus at cfg.data.url (its manifest's); logs what the corpus holds."""
    train = open_store(cfg.data, "train", cfg.model.vocab_size or None)
    held_out = open_store(cfg.data, "eval", train.vocab_size)
    seq_len = cfg.data.seq_len
    log.info("token corpus %s: vocab %d, %d training tokens (%d samples of %d tokens an epoch), %d eval tokens",
             cfg.data.url, train.vocab_size, train.total, (train.total - 1) // seq_len, seq_len, held_out.total)
    train.close()
    held_out.close()
    return train.vocab_size
