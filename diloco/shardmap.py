"""Which coordinator shard owns which parameters (docs/sharding.md).

A coordinator can run as K shard processes, each holding the global
parameters, momentum, accumulator, spool and publication of its part of the
model. Shard s owns the s-th of K contiguous runs of every fragment's
parameters (in manifest order; the whole model is one fragment without
streaming), cut at parameter boundaries where the running element count
crosses s/K of the fragment. Cutting at parameter boundaries keeps every
message as it is (a push chunk, a range, a checksum each name one parameter),
keeps each chunk's quantization scale the one the unsharded coordinator sees,
and so keeps the outer step bit-identical; the cost is imbalance of at most one
parameter per shard. Cutting each fragment (rather than the flat model once)
gives every shard a part of every fragment, so no shard idles while a fragment
syncs.

The map is a pure function of the fragment layout, the parameter shapes and
K: the coordinator's shards and the islands compute the same one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco.config import ConfigError
from diloco.fragments import Fragment, FragmentLayout

SEPARATOR = "+"  # between the shards' checksums in the run's checksum


@dataclass(frozen=True)
class ShardMap:
    shards: int
    owner: Mapping[str, int]  # parameter name -> shard index

    @staticmethod
    def of(layout: FragmentLayout, numel: Mapping[str, int], shards: int) -> ShardMap:
        if shards < 1:
            raise ConfigError(f"a coordinator has at least one shard, got {shards}")
        owner: dict[str, int] = {}
        for fragment in layout:
            owner.update(_cut(fragment, numel, shards))
        return ShardMap(shards, owner)

    def names(self, shard: int) -> list[str]:
        """The parameters shard owns, in manifest order (the map's order)."""
        return [n for n, s in self.owner.items() if s == shard]

    def split(self, names: Sequence[str]) -> list[list[str]]:
        """names per shard, each in the given order."""
        parts: list[list[str]] = [[] for _ in range(self.shards)]
        for n in names:
            parts[self.owner[n]].append(n)
        return parts

    def restrict(self, layout: FragmentLayout, shard: int) -> FragmentLayout:
        """The layout as shard s sees it: every fragment, holding only the shard's parameters."""
        return FragmentLayout(tuple(Fragment(f.index, tuple(n for n in f.names if self.owner[n] == shard), f.offset)
                                    for f in layout), layout.steps_per_round)


def _cut(fragment: Fragment, numel: Mapping[str, int], shards: int) -> dict[str, int]:
    names = fragment.names
    if len(names) < shards:
        raise ConfigError(f"fragment {fragment.index} has {len(names)} parameters, fewer than the coordinator's {shards} "
                          "shards: use fewer shards (or fewer streaming.fragments)")
    total, left = sum(numel[n] for n in names), len(names)
    owner, before, last = {}, 0, 0
    for i, n in enumerate(names):
        # The shard whose share holds the parameter's middle element, moving on by at most one shard a parameter
        # and early enough that every later shard still gets one.
        middle = min(shards - 1, (2 * before + numel[n]) * shards // (2 * total) if total else i * shards // left)
        s = 0 if i == 0 else min(max(middle, last, shards - (left - i)), last + 1)
        owner[n], before, last = s, before + numel[n], s
    return owner


def join_checksums(checksums: Sequence[str]) -> str:
    """The run's checksum of a fragment (or the model) from its shards' ones, in shard order; one shard: its own."""
    return SEPARATOR.join(checksums)


def split_checksum(checksum: str, shards: int) -> list[str]:
    """A joined checksum's parts; one of "" (nothing held yet) for each shard when it is empty."""
    if not checksum:
        return [""] * shards
    parts = checksum.split(SEPARATOR)
    if len(parts) != shards:
        raise ValueError(f"a checksum of {len(parts)} parts for {shards} coordinator shards")
    return parts


def ticket(secret: bytes, island_id: str, owner: str, ranks: int) -> str:
    """What the leading shard signs for an island it admitted; the other shards admit the island on it."""
    return hmac.new(secret, f"{island_id}\n{owner}\n{ranks}".encode(), hashlib.sha256).hexdigest()


def ticket_valid(secret: bytes, presented: str, island_id: str, owner: str, ranks: int) -> bool:
    return hmac.compare_digest(ticket(secret, island_id, owner, ranks), presented)
