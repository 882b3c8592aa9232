"""A coordinator of K shards as the core library knows it (docs/sharding.md): which shard owns which parameters,
the run's checksum from theirs, the leader's join ticket, and where their checkpoints lie.

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

Shard I of K checkpoints its part under `<checkpoint.url>/shard-I-of-K/`, a
CheckpointStore of its own; a step is the run's once every shard committed it,
and diloco-export and diloco-eval put the parts back together (load_sharded).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco.checkpoint import CheckpointStore
from diloco.config import ConfigError
from diloco.fragments import Fragment, FragmentLayout
from diloco.params import checksum

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
    """The run's checksum of a fragment (or the model) from its shards' ones, in shard order; one shard: its own.

    The one definition of a sharded run's checksum: every place that shows one (the coordinator's report, the round
    lines, an island's log) shows this. A content hash of parts cannot be combined into the whole model's hash, and no
    shard holds the whole model: so the parts are joined, not hashed again."""
    return SEPARATOR.join(checksums)


def model_checksum(tensors: Mapping[str, Any], shard_map: ShardMap | None = None) -> str:
    """The run's checksum (join_checksums) of a whole model held in one place (a one-rank island): the checksum of each
    shard's parameters, joined; without a map, or with one shard, diloco.params.checksum of them all."""
    if shard_map is None or shard_map.shards == 1:
        return checksum(tensors)
    return join_checksums([checksum({n: tensors[n] for n in names}) for names in map(shard_map.names, range(shard_map.shards))])


def split_checksum(checksum: str, shards: int) -> list[str]:
    """A joined checksum's parts; one of "" (nothing held yet) for each shard when it is empty."""
    if not checksum:
        return [""] * shards
    parts = checksum.split(SEPARATOR)
    if len(parts) != shards:
        raise ValueError(f"a checksum of {len(parts)} parts for {shards} coordinator shards")
    return parts


def sign(secret: bytes, *parts: object) -> str:
    """An HMAC under the shards' shared secret over parts: the leader's join tickets, and what the shards show each
    other (a round's statistics, the leader reading a follower)."""
    return hmac.new(secret, "\n".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def signed(secret: bytes, presented: str, *parts: object) -> bool:
    return bool(presented) and hmac.compare_digest(sign(secret, *parts), presented)


def ticket(secret: bytes, island_id: str, owner: str, ranks: int) -> str:
    """What the leading shard signs for an island it admitted; the other shards admit the island on it."""
    return sign(secret, island_id, owner, ranks)


# --- the shards' checkpoints ---------------------------------------------------------------------------

_SHARD_DIR = re.compile(r"shard-(\d+)-of-(\d+)$")


def shard_url(base: str, index: int, count: int) -> str:
    return f"{base.rstrip('/')}/shard-{index}-of-{count}"


def shards_under(base: str, storage_options: dict | None = None) -> int | None:
    """K when base holds a sharded coordinator's checkpoints (shard-I-of-K folders), None when it holds none. Raises
    ValueError when some shard's folder is missing or the folders disagree on K."""
    store = CheckpointStore(base, storage_options=storage_options)
    try:
        entries = store.fs.ls(store.root, detail=False, refresh=True)
    except FileNotFoundError:
        return None
    found = {(int(m[1]), int(m[2])) for e in entries if (m := _SHARD_DIR.search(e.rstrip("/")))}
    if not found:
        return None
    counts = {k for _, k in found}
    if len(counts) > 1:
        raise ValueError(f"{base} holds checkpoints of coordinators of {sorted(counts)} shards; give one run's checkpoint.url")
    count = counts.pop()
    missing = sorted(set(range(count)) - {i for i, _ in found})
    if missing:
        raise ValueError(f"{base} is a coordinator of {count} shards, but shards {missing} wrote no checkpoint there")
    return count


def common_step(base: str, count: int, keep_last: int = 3, storage_options: dict | None = None) -> int | None:
    """The newest step every shard committed at the same fragment rounds; None when no shard has one yet. Raises
    ValueError when the shards have checkpoints but none in common (one fell more than keep_last checkpoints behind,
    or lost its folder).

    A step number is a count of closes, not a point of the run: a shard that came back behind the others and closed a
    round before it was rolled back wrote a step numbered like the others' at other rounds (the issue-42 team run:
    step 11 at fragment rounds [6, 5] on one shard, [5, 6] on the other); resuming both there mixed two states."""
    stores = [CheckpointStore(shard_url(base, i, count), keep_last, storage_options) for i in range(count)]
    steps = [set(store.steps()) for store in stores]
    if not any(steps):
        return None
    for step in sorted(set.intersection(*steps), reverse=True):
        if _same_rounds(stores, step):
            return step
    raise ValueError(f"the coordinator's shards under {base} share no committed checkpoint at the same rounds "
                     f"(their newest: {[max(s, default=None) for s in steps]}); a shard's checkpoints are missing")


def _same_rounds(stores: list[CheckpointStore], step: int) -> bool:
    rounds = []
    for store in stores:
        meta = store.load_meta(step) or {}
        rounds.append(meta.get("fragment_rounds") or [meta.get("round")])
    return all(r == rounds[0] for r in rounds)


def load_sharded(base: str, count: int, step: int | None = None,
                 storage_options: dict | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, tensors, meta) of the whole model at step (default: the newest every shard committed): every shard's
    outer parameters and published copy together; the leading shard's meta (its history, the run's config)."""
    step = common_step(base, count, storage_options=storage_options) if step is None else step
    if step is None:
        raise ValueError(f"no committed checkpoint under {base}'s {count} shards")
    if not _same_rounds([CheckpointStore(shard_url(base, i, count), storage_options=storage_options) for i in range(count)],
                        step):
        raise ValueError(f"the shards' checkpoints {step} under {base} are at different rounds (one shard came back "
                         "behind the others); give a step they share, or none for the newest")
    tensors: dict[str, Any] = {"outer_params": {}, "published": {}}
    meta: dict[str, Any] = {}
    for i in range(count):
        part, part_meta = CheckpointStore(shard_url(base, i, count), storage_options=storage_options).load(step)
        tensors["outer_params"].update(part["outer_params"])
        tensors["published"].update(part.get("published") or {})
        meta = meta or dict(part_meta, shards=count)
    return step, tensors, meta
