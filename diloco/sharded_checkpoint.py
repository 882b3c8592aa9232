"""A coordinator checkpoint written by K shards (docs/sharding.md): where each shard writes, the step they all
committed, and the global parameters put back together (for diloco-export and diloco-eval).

Shard I of K checkpoints its part under `<checkpoint.url>/shard-I-of-K/`, a
CheckpointStore of its own; a step is the run's once every shard committed it.
"""

from __future__ import annotations

import re
from typing import Any

from diloco.checkpoint import CheckpointStore

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
    """The newest step every shard committed; None when no shard has one yet. Raises ValueError when the shards have
    checkpoints but none in common (one fell more than keep_last checkpoints behind, or lost its folder)."""
    steps = [set(CheckpointStore(shard_url(base, i, count), keep_last, storage_options).steps()) for i in range(count)]
    if not any(steps):
        return None
    common = set.intersection(*steps)
    if not common:
        raise ValueError(f"the coordinator's shards under {base} share no committed checkpoint "
                         f"(their newest: {[max(s, default=None) for s in steps]}); a shard's checkpoints are missing")
    return max(common)


def load_sharded(base: str, count: int, step: int | None = None,
                 storage_options: dict | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, tensors, meta) of the whole model at step (default: the newest every shard committed): every shard's
    outer parameters and published copy together; the leading shard's meta (its history, the run's config)."""
    step = common_step(base, count, storage_options=storage_options) if step is None else step
    if step is None:
        raise ValueError(f"no committed checkpoint under {base}'s {count} shards")
    tensors: dict[str, Any] = {"outer_params": {}, "published": {}}
    meta: dict[str, Any] = {}
    for i in range(count):
        part, part_meta = CheckpointStore(shard_url(base, i, count), storage_options=storage_options).load(step)
        tensors["outer_params"].update(part["outer_params"])
        tensors["published"].update(part.get("published") or {})
        meta = meta or dict(part_meta, shards=count)
    return step, tensors, meta
