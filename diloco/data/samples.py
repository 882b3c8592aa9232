"""A corpus as numbered samples: stream position -> one window of seq_len + 1 tokens.

A finite corpus is a token stream (a TokenStore: prepared shards, an MDS
dataset, or an array in memory) cut into windows: sample i holds tokens
[i * L, i * L + L + 1) for L = seq_len, the last token of one window being the
first of the next. The run reads the samples through positions 0, 1, 2, ...:
position p belongs to epoch p // n (n samples an epoch) and names the sample
that epoch's shuffled order puts there. The coordinator leases ranges of
positions to islands (coordinator/ledger.py), which is how every sample is
trained on at most once an epoch.

The order is a seeded block shuffle: the epoch's full blocks of `block`
consecutive samples in a random order (the short last block, if any, stays
last), and the samples inside each block shuffled too. A lease of consecutive
positions then reads a few blocks, so a shard cache stays small, while batches
still mix samples from across the corpus over an epoch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import numpy as np
import torch


class TokenStore(Protocol):
    """One split of a tokenized corpus as one stream of tokens."""

    total: int  # tokens in the split
    vocab_size: int
    eos_id: int

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the split, across shard boundaries; thread-safe."""
        ...

    def prefetch(self, start: int, stop: int) -> None:
        """A hint that tokens [start, stop) are needed soon; returns at once."""
        ...

    def close(self) -> None: ...


class SampleOrder:
    """Position -> sample index, a seeded block shuffle per epoch (see the module docstring)."""

    def __init__(self, n_samples: int, seed: int, block: int = 256):
        if n_samples < 1:
            raise ValueError("a corpus needs at least one sample")
        self.n, self.seed, self.block = n_samples, seed, max(1, min(block, n_samples))
        self.full = n_samples // self.block  # full blocks; a short last block stays last
        self._blocks: OrderedDict[int, np.ndarray] = OrderedDict()  # epoch -> block order (a small LRU)
        self._inner: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def _block_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._blocks:
            self._blocks[epoch] = np.random.default_rng([self.seed, epoch, 0xB10C]).permutation(self.full)
            while len(self._blocks) > 2:
                self._blocks.popitem(last=False)
        return self._blocks[epoch]

    def _within(self, epoch: int, block: int, size: int) -> np.ndarray:
        key = (epoch, block)
        if key not in self._inner:
            self._inner[key] = np.random.default_rng([self.seed, epoch, block, 0x1A5]).permutation(size)
            while len(self._inner) > 64:
                self._inner.popitem(last=False)
        self._inner.move_to_end(key)
        return self._inner[key]

    def indices(self, start: int, count: int) -> np.ndarray:
        """The sample indices at positions start .. start + count - 1."""
        out = np.empty(count, dtype=np.int64)
        pos, i = start, 0
        while i < count:
            epoch, r = divmod(pos, self.n)
            k, offset = divmod(r, self.block)
            if k < self.full:
                first, size = int(self._block_order(epoch)[k]) * self.block, self.block
            else:  # the short last block
                first, size = self.full * self.block, self.n - self.full * self.block
            take = min(count - i, size - offset)
            out[i : i + take] = first + self._within(epoch, k, size)[offset : offset + take]
            i, pos = i + take, pos + take
        return out


class WindowSamples:
    """Numbered windows of a TokenStore, read through the shuffled order."""

    def __init__(self, store: TokenStore, seq_len: int, seed: int, block: int = 256):
        self.store, self.seq_len = store, seq_len
        self.epoch_size = (store.total - 1) // seq_len
        if self.epoch_size < 1:
            raise ValueError(f"the corpus has {store.total} tokens: too few for one window of seq_len {seq_len}")
        self.order = SampleOrder(self.epoch_size, seed, block)

    def _spans(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """(first sample, samples, index into the output) of each run of consecutive samples."""
        idx = self.order.indices(start, count)
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        bounds = [0, *breaks.tolist(), count]
        return [(int(idx[a]), b - a, a) for a, b in zip(bounds, bounds[1:])]

    def sequences(self, start: int, count: int) -> torch.Tensor:
        """The windows at positions start .. start + count - 1: int64 (count, seq_len + 1)."""
        L = self.seq_len
        idx = self.order.indices(start, count)
        order = np.argsort(idx, kind="stable")
        out = np.empty((count, L + 1), dtype=np.int64)
        # Read in corpus order, one read per run of neighbouring samples: a block is one read.
        sorted_idx = idx[order]
        breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
        bounds = [0, *breaks.tolist(), count]
        for a, b in zip(bounds, bounds[1:]):
            first, n = int(sorted_idx[a]), b - a
            tokens = np.asarray(self.store.read(first * L, (first + n) * L + 1), dtype=np.int64)
            windows = np.lib.stride_tricks.sliding_window_view(tokens, L + 1)[::L]
            out[order[a:b]] = windows[:n]
        return torch.from_numpy(out)

    def prefetch(self, start: int, count: int) -> None:
        L = self.seq_len
        for first, n, _ in self._spans(start, count):
            self.store.prefetch(first * L, (first + n) * L + 1)


def eval_windows(store: TokenStore, seq_len: int, n: int) -> torch.Tensor:
    """n windows evenly spread over a held-out split, the same every time: int64 (n, seq_len + 1)."""
    span = store.total - seq_len - 1
    if span < 0:
        raise ValueError(f"the held-out split has {store.total} tokens: too few for a window of seq_len {seq_len}")
    starts = np.linspace(0, span, num=n, dtype=np.int64)
    return torch.stack([torch.from_numpy(np.asarray(store.read(int(s), int(s) + seq_len + 1), dtype=np.int64))
                        for s in starts])
