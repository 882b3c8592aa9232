"""Island checkpoints: model, inner optimizer, theta_global, error feedback, data position, RNG,
and where each fragment stands.

Written right after a round's result landed, with no exchange in flight (so no
network state is saved), under the step = rounds landed over all fragments
(the round without streaming), so a resumed island replays exactly what it
would have done: with fixed seeds on CPU a stopped-and-resumed run ends
bit-identical to one that never stopped. With tau larger than the spacing
between fragments' syncs an exchange is always in flight and no checkpoint is
ever written (a warning says so).
"""

from __future__ import annotations

import logging

import torch

from diloco.checkpoint import CheckpointStore, rng_state, set_rng_state

log = logging.getLogger(__name__)


def save(island, store: CheckpointStore) -> str:
    step = sum(island.rounds)
    tensors = {
        "model": {n: p.detach().clone() for n, p in island.model.state_dict().items()},
        "optimizer": island.optimizer.state_dict(),
        "global_params": {n: t.clone() for n, t in island.global_params.items()},
        "feedback": island.feedback.state_dict() if island.feedback is not None else {},
        "data": island.data.state_dict(),
        "rng": rng_state(),
    }
    if island.eager is not None:
        tensors["eager"] = [
            {
                "momentum": e.replica.state_dict(),
                "prev_mean": e.prev_mean or {},
                "prev_own": e.prev_own or {},
            }
            for e in island.eager
        ]
    meta = {
        "island_id": island.island_id,
        "round": island.round,
        "global_checksum": island.global_checksum,
        "config_digest": island.cfg.digest(),
        "step": island.step,
        "fragment_rounds": list(island.rounds),
        "fragment_checksums": list(island.checksums),
        "last_sync": list(island.last_sync),
        "pending_loss": [list(p) for p in island.pending_loss],
        "eager_share": [e.share for e in island.eager] if island.eager is not None else [],
    }
    where = store.save(step, tensors, meta)
    log.info("%s: checkpoint at fragment rounds %s written to %s", island.island_id, island.rounds, where)
    return where


def peek(store: CheckpointStore) -> dict | None:
    """The newest checkpoint's metadata (to rejoin under the same island id), or None."""
    return store.load_meta()


def restore(island, store: CheckpointStore, prefer_step: int | None = None) -> int:
    """Loads a checkpoint into island: the one of prefer_step (the coordinator's rounds closed over all
    fragments) if kept, else the newest. Returns its step.

    Taking the coordinator's step, not simply the newest, matters after a crash
    that caught the island a round ahead of the coordinator's last checkpoint.
    The island then fetches the global parameters and resyncs every fragment
    whose round or checksum differs from the coordinator's.
    """
    step = prefer_step if prefer_step is not None and prefer_step in store.steps() else None
    tensors, meta = store.load(step)
    if meta["config_digest"] != island.cfg.digest():
        raise ValueError(f"island checkpoint at {store.url} is for another config ({meta['config_digest']})")
    with torch.no_grad():
        island.model.load_state_dict(tensors["model"])
        for name, t in tensors["global_params"].items():
            island.global_params[name].copy_(t)
    island.optimizer.load_state_dict(tensors["optimizer"])
    if island.feedback is not None and tensors["feedback"]:
        island.feedback.load_state_dict(tensors["feedback"])
    island.data.load_state_dict(tensors["data"])
    set_rng_state(tensors["rng"])
    h = island.cfg.inner.steps_per_round
    island.rounds = list(meta.get("fragment_rounds") or [meta["round"]])
    island.checksums = list(meta.get("fragment_checksums") or [meta["global_checksum"]])
    island.step = meta.get("step", meta["round"] * h)
    island.last_sync = list(meta.get("last_sync") or [island.step] * len(island.rounds))
    island.pending_loss = [list(p) for p in meta.get("pending_loss") or [[0.0, 0]] * len(island.rounds)]
    if island.eager is not None and "eager" in tensors:
        for e, saved, share in zip(island.eager, tensors["eager"], meta["eager_share"]):
            e.replica.load_state_dict(saved["momentum"])
            e.prev_mean, e.prev_own, e.share = saved["prev_mean"] or None, saved["prev_own"] or None, share
    island.restored = True
    log.info("%s resumed from %s at inner step %d, fragment rounds %s", meta["island_id"], store.url, island.step, island.rounds)
    return meta.get("step", meta["round"])
