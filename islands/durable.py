"""Island checkpoints: model, inner optimizer, theta_global, error feedback, data position, RNG.

Written at round boundaries (just after adopting a round's result), so a
resumed island replays exactly what it would have done: with fixed seeds on
CPU a stopped-and-resumed run ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import logging

import torch

from diloco.checkpoint import CheckpointStore, rng_state, set_rng_state

log = logging.getLogger(__name__)


def save(island, store: CheckpointStore) -> str:
    tensors = {
        "model": {n: p.detach().clone() for n, p in island.model.state_dict().items()},
        "optimizer": island.optimizer.state_dict(),
        "global_params": {n: t.clone() for n, t in island.global_params.items()},
        "feedback": island.feedback.state_dict() if island.feedback is not None else {},
        "data": island.data.state_dict(),
        "rng": rng_state(),
    }
    meta = {
        "island_id": island.island_id,
        "round": island.round,
        "global_checksum": island.global_checksum,
        "config_digest": island.cfg.digest(),
    }
    where = store.save(island.round, tensors, meta)
    log.info("%s: checkpoint of round %d written to %s", island.island_id, island.round, where)
    return where


def peek(store: CheckpointStore) -> dict | None:
    """The newest checkpoint's metadata (to rejoin under the same island id), or None."""
    return store.load_meta()


def restore(island, store: CheckpointStore, prefer_round: int | None = None) -> int:
    """Loads a checkpoint into island: the one of prefer_round (the coordinator's round) if
    kept, else the newest. Returns its round.

    Taking the coordinator's round, not simply the newest, matters after a crash
    that caught the island a round ahead of the coordinator's last checkpoint.
    """
    step = prefer_round if prefer_round is not None and prefer_round in store.steps() else None
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
    island.global_checksum = meta["global_checksum"]
    log.info("%s resumed from %s at round %d", meta["island_id"], store.url, meta["round"])
    return meta["round"]
