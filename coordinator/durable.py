"""Coordinator checkpoints: everything a restarted coordinator needs to carry on.

Global (outer) parameters, the published copy islands hold (the downlink's error
feedback), the outer optimizer's momentum, the round counter, membership and
the run's history go to a CheckpointStore (any fsspec URL). The store writes the
data first and a commit marker last, so a checkpoint torn by a crash is never
loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from google.protobuf import json_format

from coordinator.state import CoordinatorState, Events, Island, Phase
from diloco.checkpoint import CheckpointStore
from diloco.v1 import diloco_pb2 as pb

log = logging.getLogger(__name__)


def snapshot(state: CoordinatorState) -> tuple[dict, dict]:
    """(tensors, meta) at a round boundary. Caller holds the parameters' read lock."""
    with state.cond:
        tensors = {
            "outer_params": {n: t.clone() for n, t in state.outer.params.items()},
            "published": state.publication.state_dict(),
            "outer_optimizer": state.outer.state_dict(),
        }
        meta = {
            "round": state.round,
            "finished": state.phase is Phase.FINISHED,
            "joined": state.joined,
            "islands": [
                {"island_id": i.island_id, "hostname": i.hostname, "shard": i.shard, "key": i.key} for i in state.islands.values()
            ],
            "departed": [dataclasses.asdict(i) for i in state.departed],
            "summaries": [json_format.MessageToDict(s) for s in state.summaries],
            "initial_eval_loss": state.initial_eval_loss,
            "events": dataclasses.asdict(state.events),
            "config_digest": state.cfg.digest(),
            "checksum": state.checksum,
            "wall_time": time.time(),
        }
    return tensors, meta


def save(state: CoordinatorState, store: CheckpointStore) -> str:
    state.param_lock.acquire_read()
    try:
        tensors, meta = snapshot(state)
    finally:
        state.param_lock.release_read()
    where = store.save(meta["round"], tensors, meta)
    log.info("checkpoint of round %d written to %s", meta["round"], where)
    return where


def restore(state: CoordinatorState, store: CheckpointStore) -> bool:
    """Loads the newest committed checkpoint into state; False when there is none."""
    if store.latest() is None:
        return False
    tensors, meta = store.load()
    if meta["config_digest"] != state.cfg.digest():
        raise ValueError(
            f"checkpoint at {store.url} is for config {meta['config_digest']}, not {state.cfg.digest()}; "
            "resume with the config the run started with"
        )
    now = state.clock()
    with torch.no_grad():
        for name, t in tensors["outer_params"].items():
            state.outer.params[name].copy_(t)
    state.outer.load_state_dict(tensors["outer_optimizer"])
    state.publication.load_state_dict(tensors["published"])
    if state.checksum != meta["checksum"]:
        raise ValueError(f"checkpoint at {store.url} round {meta['round']} does not reproduce its own checksum")
    with state.cond:
        state.round = meta["round"]
        state.phase = Phase.FINISHED if meta["finished"] else Phase.OPEN
        state.round_opened_at = now
        state.joined = meta["joined"]
        # Islands get a fresh lease: they are reconnecting right now.
        state.islands = {
            i["island_id"]: Island(i["island_id"], i["hostname"], i["shard"], now, key=i.get("key", "")) for i in meta["islands"]
        }
        state.departed = [Island(**i) for i in meta["departed"]]
        state.summaries = [json_format.ParseDict(s, pb.RoundSummary()) for s in meta["summaries"]]
        state.initial_eval_loss = meta["initial_eval_loss"]
        state.events = Events(**meta["events"])
        state.events.restarts += 1
        state.restored_round = state.round
        state.restored_at = now
    log.info("resumed from %s at round %d with %d islands", store.url, state.round, len(state.islands))
    return True
