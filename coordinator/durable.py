"""Coordinator checkpoints: everything a restarted coordinator needs to carry on.

Global (outer) parameters, the published copy islands hold (the downlink's error
feedback), the outer optimizers' momentum and the round counters (one of each
per fragment with Streaming DiLoCo), membership and the run's history go to a
CheckpointStore (any fsspec URL). The store writes the data first and a commit
marker last, so a checkpoint torn by a crash is never loaded.

The checkpoint's step is the number of rounds closed over all fragments (the
round without streaming); islands name theirs the same way, so a resumed
island can pick the checkpoint that matches the coordinator's.
"""

from __future__ import annotations

import logging
import time

import torch
from google.protobuf import json_format

from coordinator.state import CoordinatorState
from diloco.checkpoint import CheckpointStore
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger(__name__)


def snapshot(state: CoordinatorState) -> tuple[dict, dict]:
    """(tensors, meta) at round boundaries. Caller holds every fragment's read lock."""
    whole = state.whole_checksum_locked()
    with state.cond:
        fragments = [f.state_dict() for f in state.fragments]
        tensors = {
            "outer_params": {n: t.clone() for n, t in state.outer_params.items()},
            "published": {n: t for f in fragments for n, t in f["published"].items()},
            "outer_optimizers": [f["outer"] for f in fragments],
        }
        meta = {
            "step": state.total_rounds_closed(),
            "round": state.round,
            "fragment_rounds": [f["round"] for f in fragments],
            "fragment_checksums": [f.checksum for f in state.fragments],
            "fragment_last": [f["last"] for f in fragments],
            "fragment_guards": [f["guard"] for f in fragments],  # the norm guard's history: it judges on after a resume
            "finished": state.finished,
            **state.members.state_dict(),
            "summaries": [json_format.MessageToDict(s) for s in state.summaries],
            "initial_eval_loss": state.initial_eval_loss,
            "ledger": state.ledger.state_dict() if state.ledger is not None else None,
            "config_digest": state.cfg.digest(),
            "config_toml": state.cfg.to_toml(),  # the whole run config: diloco-export rebuilds the model from it
            "checksum": whole,
            "wall_time": time.time(),
        }
    return tensors, meta


def save(state: CoordinatorState, store: CheckpointStore) -> str:
    with state.reading_all():
        tensors, meta = snapshot(state)
    where = store.save(meta["step"], tensors, meta)
    if len(state.fragments) > 1:
        log.info("checkpoint at fragment rounds %s written to %s", meta["fragment_rounds"], where)
    else:
        log.info("checkpoint of round %d written to %s", meta["round"], where)
    return where


def restore(state: CoordinatorState, store: CheckpointStore, step: int | None = None) -> bool:
    """Loads the committed checkpoint of step (default: the newest) into state; False when there is none."""
    if store.latest() is None:
        return False
    tensors, meta = store.load(step)
    if meta["config_digest"] != state.cfg.digest():
        raise ValueError(
            f"checkpoint at {store.url} is for config {meta['config_digest']}, not {state.cfg.digest()}; "
            "resume with the config the run started with"
        )
    fragments = state.fragments
    optimizers = tensors.get("outer_optimizers") or [tensors["outer_optimizer"]]
    rounds = meta.get("fragment_rounds") or [meta["round"]]
    if len(optimizers) != len(fragments) or len(rounds) != len(fragments):
        raise ValueError(f"checkpoint at {store.url} has {len(rounds)} fragments, the run {len(fragments)}")
    outer_params = state.outer_params
    with torch.no_grad():
        for name, t in tensors["outer_params"].items():
            outer_params[name].copy_(t)
    last = meta.get("fragment_last") or [[0, 0]] * len(fragments)
    guards = meta.get("fragment_guards") or [{}] * len(fragments)  # none in a checkpoint written before they were kept
    for f, optimizer, round_, islands_tokens, guard in zip(fragments, optimizers, rounds, last, guards):
        published = {n: t for n, t in tensors["published"].items() if n in f.manifest.shapes}
        f.load_state_dict({"round": round_, "last": list(islands_tokens), "outer": optimizer, "published": published,
                           "guard": guard}, finished=meta["finished"])
    if state.checksum != meta["checksum"]:
        raise ValueError(f"checkpoint at {store.url} round {meta['round']} does not reproduce its own checksum")
    state.members.load_state_dict(meta)
    if state.ledger is not None:
        if not meta.get("ledger"):
            raise ValueError(f"checkpoint at {store.url} holds no data ledger: it was not written by a run on a token corpus")
        state.ledger.load_state_dict(meta["ledger"])
    with state.cond:
        state.summaries = [json_format.ParseDict(s, pb.RoundSummary()) for s in meta["summaries"]]
        state.initial_eval_loss = meta["initial_eval_loss"]
    where = f"round {state.round}" if len(fragments) == 1 else f"fragment rounds {rounds}"
    log.info("resumed from %s at %s with %d islands", store.url, where, len(state.islands))
    return True
