"""Streaming DiLoCo's fragments: which parameters sync together, and when.

The model splits into P fragments of transformer blocks (`streaming.pattern`):

- strided (default): block i belongs to fragment i % P, so every fragment
  spans the depth of the network (blocks 0, P, 2P, ... in fragment 0);
- sequential: P contiguous groups of blocks, the first n_layers % P groups one
  block larger.

Parameters outside the blocks: the embedding goes with block 0's fragment,
every other one (the final norm, and lm_head when the embedding is untied)
with the last block's.

Fragment f syncs at its own offset o_f = f * H // P. Counting c, the inner
steps completed so far, fragment f pushes round r after c = (r + 1) * H - o_f
steps, except that every fragment's last round (r = R - 1) ends with the run,
at c = R * H. So fragment 0 syncs at multiples of H like plain DiLoCo, the
others earlier by their offset; each fragment's first round is o_f steps
shorter than H and its last one o_f steps longer; every fragment trains for
all R * H steps. With P = 1 this is exactly plain DiLoCo's schedule.

The layout is a pure function of the config (model.n_layers and the
[streaming] table, both part of the config digest), so coordinator and islands
compute the same one; Join also sends it and the island checks it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.config import ConfigError, RunConfig

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
EMBEDDING = "embed.weight"


def block_of(name: str) -> int | None:
    """The transformer block a parameter belongs to, or None for the embedding and the final norm."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Fragment:
    index: int
    names: tuple[str, ...]  # in the model's (manifest) order
    offset: int  # o_f, in inner steps


@dataclass(frozen=True)
class FragmentLayout:
    fragments: tuple[Fragment, ...]
    steps_per_round: int  # H

    def __len__(self) -> int:
        return len(self.fragments)

    def __iter__(self):
        return iter(self.fragments)

    def __getitem__(self, index: int) -> Fragment:
        return self.fragments[index]

    def fragment_of(self, name: str) -> int:
        for fragment in self.fragments:
            if name in fragment.names:
                return fragment.index
        raise KeyError(f"parameter {name!r} is in no fragment")

    def subset(self, index: int, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The fragment's entries of a name -> tensor mapping (the same tensor objects)."""
        return {n: tensors[n] for n in self.fragments[index].names}

    # --- the schedule (c: inner steps completed so far) -----------------------------------

    def round_end(self, index: int, round_: int, total_rounds: int) -> int:
        """c at which fragment index pushes round round_."""
        h = self.steps_per_round
        if round_ >= total_rounds - 1:
            return total_rounds * h
        return (round_ + 1) * h - self.fragments[index].offset

    def round_start(self, index: int, round_: int, total_rounds: int) -> int:
        return 0 if round_ == 0 else self.round_end(index, round_ - 1, total_rounds)

    def sync_points(self, index: int, total_rounds: int) -> list[int]:
        return [self.round_end(index, r, total_rounds) for r in range(total_rounds)]

    def start_step(self, rounds: Sequence[int], total_rounds: int) -> int:
        """Where an island joining fragments at these rounds trains from: the earliest of their round
        starts, so it trains at least one step for every fragment before that fragment's next sync.

        For P = 1, round * H, as in plain DiLoCo.
        """
        starts = [self.round_start(f, r, total_rounds) for f, r in enumerate(rounds) if r < total_rounds]
        return min(starts) if starts else total_rounds * self.steps_per_round

    def min_spacing(self) -> int:
        """The fewest inner steps between two syncs of different fragments (H without streaming)."""
        offsets = sorted(f.offset for f in self.fragments)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])] + [self.steps_per_round - offsets[-1] + offsets[0]]
        return min(gaps)

    def describe(self) -> str:
        parts = []
        for f in self.fragments:
            blocks = sorted({b for n in f.names if (b := block_of(n)) is not None})
            extra = [n for n in f.names if block_of(n) is None]
            parts.append(f"fragment {f.index} (offset {f.offset}): blocks {blocks}" + (f" + {', '.join(extra)}" if extra else ""))
        return "; ".join(parts)


def layout_for(names: Iterable[str], cfg: RunConfig) -> FragmentLayout:
    """The run's fragment layout over the parameter names (in manifest order)."""
    names = list(names)
    p, n_layers, h = cfg.streaming.fragments, cfg.model.n_layers, cfg.inner.steps_per_round
    if p > n_layers:
        raise ConfigError(f"streaming.fragments={p} exceeds model.n_layers={n_layers}")
    if cfg.streaming.pattern == "strided":
        owner = [i % p for i in range(n_layers)]
    elif cfg.streaming.pattern == "sequential":
        size, extra = divmod(n_layers, p)
        owner = []
        for f in range(p):
            owner += [f] * (size + (1 if f < extra else 0))
    else:
        raise ConfigError(f"streaming.pattern must be 'strided' or 'sequential', got {cfg.streaming.pattern!r}")
    members: list[list[str]] = [[] for _ in range(p)]
    for name in names:
        block = block_of(name)
        if block is None:
            block = 0 if name == EMBEDDING else n_layers - 1
        if block >= n_layers:
            raise ConfigError(f"parameter {name} names block {block} but model.n_layers={n_layers}")
        members[owner[block]].append(name)
    fragments = tuple(Fragment(f, tuple(members[f]), f * h // p) for f in range(p))
    for f in fragments:
        if not f.names:
            raise ConfigError(f"fragment {f.index} holds no parameters; use fewer streaming.fragments")
    return FragmentLayout(fragments, h)
