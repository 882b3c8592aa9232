"""The tokenizer `diloco-data prepare` uses (Hugging Face `tokenizers`), and the tokenizing worker.

A trained tokenizer is a byte-level BPE (GPT-2's pre-tokenization, every byte in the initial
alphabet so no text is unknown) with the end-of-document token as its one special token (id 0).
Training is deterministic: the same documents and vocabulary size give the same tokenizer.json.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable

import numpy as np

from diloco.data.corpus import is_eval


class TokenizerError(ValueError):
    """A tokenizer that cannot be used as asked; the message says why."""


def train_bpe(texts: Iterable[str], vocab_size: int, eos_token: str) -> str:
    """A byte-level BPE trained on texts; its tokenizer.json text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least 257 "
                             "(256 bytes and the end-of-document token)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


def describe(tokenizer_json: str, eos_token: str, where: str) -> tuple[int, int]:
    """(vocab_size, eos_id) of a tokenizer.json; TokenizerError when it does not load or lacks eos_token."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(tokenizer_json)
    except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
        raise TokenizerError(f"{where}: not a Hugging Face tokenizers file ({e})") from None
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise TokenizerError(f"{where}: has no token {eos_token!r} to end documents with; name one it has "
                             "with --eos-token")
    return tokenizer.get_vocab_size(with_added_tokens=True), eos_id


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Worker:
    """Tokenizes batches of documents in a worker process (built there by `start_worker`)."""

    def __init__(self, tokenizer_json: str, eos_id: int, eval_fraction: float):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.eos_id, self.eval_fraction = eos_id, eval_fraction

    def __call__(self, docs: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(train tokens, eval tokens, train documents, eval documents), each document followed by eos."""
        train: list[list[int]] = []
        held: list[list[int]] = []
        eos = [self.eos_id]
        for text, encoding in zip(docs, self.tokenizer.encode_batch(docs, add_special_tokens=False)):
            side = held if is_eval(text, self.eval_fraction) else train
            side.append(encoding.ids)
            side.append(eos)
        return (np.fromiter(itertools.chain.from_iterable(train), np.uint32),
                np.fromiter(itertools.chain.from_iterable(held), np.uint32), len(train) // 2, len(held) // 2)


_worker: Worker | None = None  # one per worker process: a Pool's initializer can only leave state here


def start_worker(tokenizer_json: str, eos_id: int, eval_fraction: float) -> None:
    global _worker
    # Each process is one core's worth; tokenizers' own thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = Worker(tokenizer_json, eos_id, eval_fraction)


def tokenize_batch(docs: list[str]) -> tuple[np.ndarray, np.ndarray, int, int]:
    assert _worker is not None, "start_worker runs first in every worker process"
    return _worker(docs)
