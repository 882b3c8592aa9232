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
    """(tensors, meta) at round boundaries. Caller holds every fragment's read lock."""
    whole = state.whole_checksum_locked()
    with state.cond:
        tensors = {
            "outer_params": {n: t.clone() for n, t in state.outer_params.items()},
            "published": {n: t for f in state.fragments for n, t in f.publication.state_dict().items()},
            "outer_optimizers": [f.outer.state_dict() for f in state.fragments],
        }
        meta = {
            "step": state.total_rounds_closed(),
            "round": state.round,
            "fragment_rounds": [f.round for f in state.fragments],
            "fragment_checksums": [f.checksum for f in state.fragments],
            "fragment_last": [[f.last_islands, f.last_tokens] for f in state.fragments],
            "finished": state.finished,
            "joined": state.joined,
            "islands": [
                {"island_id": i.island_id, "hostname": i.hostname, "shard": i.shard, "key": i.key} for i in state.islands.values()
            ],
            "departed": [dataclasses.asdict(i) for i in state.departed],
            "summaries": [json_format.MessageToDict(s) for s in state.summaries],
            "initial_eval_loss": state.initial_eval_loss,
            "events": dataclasses.asdict(state.events),
            "config_digest": state.cfg.digest(),
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
    for f, optimizer, round_, (islands, tokens) in zip(fragments, optimizers, rounds, last):
        f.outer.load_state_dict(optimizer)
        f.publication.load_state_dict({n: t for n, t in tensors["published"].items() if n in f.manifest.shapes})
        with state.cond:
            f.round = round_
            f.phase = Phase.FINISHED if meta["finished"] or round_ >= state.cfg.rounds.rounds else Phase.OPEN
            f.round_opened_at = now
            f.restored_round = round_
            f.restored_at = now
            f.last_islands, f.last_tokens = islands, tokens
    if state.checksum != meta["checksum"]:
        raise ValueError(f"checkpoint at {store.url} round {meta['round']} does not reproduce its own checksum")
    with state.cond:
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
    log.info("resumed from %s at round %s with %d islands", store.url,
             state.round if len(fragments) == 1 else f"s {rounds} (per fragment)", len(state.islands))
    return True
