"""Checkpoints of a sharded island with torch.distributed.checkpoint (DCP), on any fsspec URL.

What is saved, at the first torchft step of every --checkpoint-every'th round
(just after the previous round's result was adopted, so theta_local ==
theta_global and the inner optimizer carries over):

- the model's shards and the inner optimizer's state, from
  torch.distributed.checkpoint.state_dict (get_model_state_dict,
  get_optimizer_state_dict): DTensors keyed by parameter name;
- the rank's shard of theta_global and the uplink's error-feedback residual,
  wrapped as DTensors with their parameter's placement (the flat shard viewed
  in the parameter's local shape). So the checkpoint holds whole logical
  tensors: it reloads into any number of ranks (DCP reshards), can be read
  with DCP's own tools, and has no per-rank layout to get wrong;
- each rank's RNG states, under a per-rank key. Nothing random is drawn today
  (batches are a pure function of the inner step: StepIndexedStream; the
  model has no dropout; parameters are fetched, not initialised), so this is
  only a guard for later changes;
- in meta.json: the island's id and key, the Position, the config digest.

Who saves: only the replica group that is rank 0 of that step's torchft
quorum (all groups hold the same state); the other groups wait in the step's
all-reduce meanwhile, so a save must fit in --ft-timeout. If that group dies
mid-save, the step does not commit and is redone: the next rank-0 group saves
the round again.

Commit rule (CheckpointStore's folder steps): rank 0 of the saving group
empties step-NNNNNNNNNN/ (un-committing it first), every rank writes its DCP
files, and once dcp.save returned everywhere, rank 0 writes meta.json and last
the COMMITTED marker listing every file and its size. A step without it, or
whose files differ from it, is never loaded.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from diloco.checkpoint import CheckpointError, CheckpointStore, rng_state, set_rng_state
from islands.evidence import maybe_fault

log = logging.getLogger(__name__)


def _as_dtensors(model: torch.nn.Module, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat per-rank shards (theta_global, residual) as DTensors placed like their parameters.

    On a CPU mesh these are views of the shards (DCP reads into them in place);
    on a GPU mesh from_local copies each to the GPU for the save.
    """
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            local = flat[name].view(p.to_local().shape)
            out[name] = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        else:
            out[name] = flat[name].view(p.shape)
    return out


def _copy_back(flat: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, t in loaded.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.data_ptr() != flat[name].data_ptr():
                flat[name].copy_(local.reshape(-1))


class ShardCheckpoint:
    """One island's checkpoints under url: written by one replica group, read by every group on --resume."""

    def __init__(self, url: str, every: int, world, keep_last: int = 3):
        self.store = CheckpointStore(url, keep_last=keep_last)
        self.every = max(1, every)
        self.world = world
        self.last: int | None = None  # the round last saved or restored here (or the one this process started in)
        protocol = self.store.fs.protocol
        self.local = (protocol if isinstance(protocol, str) else protocol[0]) in ("file", "local")  # fsync only there

    def _on_leader(self, fn):
        """fn() on rank 0 of the group; its result, or its error raised on every rank."""
        result, error = None, None
        if self.world.is_leader:
            try:
                result = fn()
            except (CheckpointError, OSError) as e:
                error = str(e)
        result, error = self.world.broadcast_object((result, error))
        if error:
            raise CheckpointError(error)
        return result

    def _state(self, island, with_optimizer: bool, rng_ranks: int) -> dict:
        state = {"model": get_model_state_dict(island.model), "global": _as_dtensors(island.model, island.global_shard)}
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(island.model, island.optimizer)
        if island.feedback is not None:
            state["feedback"] = _as_dtensors(island.model, island.feedback.committed)
        if self.world.rank < rng_ranks:
            state[f"rng-rank{self.world.rank}"] = rng_state()
        return state

    # --- saving ------------------------------------------------------------------------

    def maybe_save(self, island) -> None:
        """Called at the top of every torchft step: saves the round if it is due and this group is the saver."""
        s = island.state
        if self.last is None:
            self.last = s.round  # nothing trained here yet
        if s.pos or s.round == self.last or s.round % self.every or s.finished:
            return
        if island.replicas.participating_rank() != 0:
            return
        self.save(island)

    def save(self, island) -> str:
        s, started = island.state, time.monotonic()
        url = self._on_leader(lambda: self.store.begin_files(s.round))
        # get_optimizer_state_dict would initialise an empty optimizer (a fresh one after a divergence) by stepping it.
        with_optimizer = bool(island.optimizer.state)
        try:  # DCP raises on every rank when any rank failed
            dcp.save(self._state(island, with_optimizer, self.world.world_size), storage_writer=FsspecWriter(url, sync_files=self.local))
        except CheckpointException as e:
            raise CheckpointError(f"could not write checkpoint {s.round} to {url}: {e}") from e
        meta = {
            "island_id": s.island_id, "island_key": island.spec.key, "round": s.round, "position": dataclasses.asdict(s),
            "config_digest": island.cfg.digest(), "format": "torch.distributed.checkpoint", "optimizer": with_optimizer,
            "world_size": self.world.world_size, "saved_by_group": island.spec.group, "replica_groups": island.spec.groups,
            "wall_time": time.time(),
        }
        maybe_fault("die-before-commit", island.spec.group, self.world.rank, s.round)  # tests: a torn save
        where = self._on_leader(lambda: self.store.commit_files(s.round, meta))
        self.last = s.round
        if self.world.is_leader:
            log.info("%s group %d: checkpoint of round %d written to %s in %.2fs", s.island_id, island.spec.group, s.round, where, time.monotonic() - started)
        return where

    # --- resuming ------------------------------------------------------------------------

    def choose(self, prefer_round: int | None = None) -> tuple[int, dict] | None:
        """(step, meta) to resume from: prefer_round's if committed and whole, else the newest that is; None if none."""
        def pick():
            if not self.store.steps():
                return None
            if prefer_round is not None and prefer_round in self.store.steps():
                try:
                    return self.store.load_files(prefer_round)
                except CheckpointError as e:
                    log.warning("skipping checkpoint: %s", e)
            return self.store.load_files()
        return self._on_leader(pick)

    def restore(self, island, prefer_round: int | None = None) -> int | None:
        """Loads a checkpoint into island (every rank of the group); returns its round, None if there is none."""
        chosen = self.choose(prefer_round)
        if chosen is None:
            log.warning("no committed checkpoint under %s; starting this island afresh", self.store.url)
            return None
        step, meta = chosen
        if meta["config_digest"] != island.cfg.digest():
            raise ValueError(f"island checkpoint at {self.store.url} is for another config ({meta['config_digest']})")
        state = self._state(island, meta["optimizer"], meta["world_size"])
        try:
            dcp.load(state, storage_reader=FsspecReader(self.store.step_url(step)))
        except CheckpointException as e:
            raise CheckpointError(f"could not read checkpoint {step} under {self.store.url}: {e}") from e
        set_model_state_dict(island.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(island.model, island.optimizer, state["optimizer"])
        _copy_back(island.global_shard, state["global"])
        if island.feedback is not None and "feedback" in state:
            _copy_back(island.feedback.committed, state["feedback"])
        if f"rng-rank{self.world.rank}" in state:
            set_rng_state(state[f"rng-rank{self.world.rank}"])
        self.last = step
        if prefer_round is not None and step != prefer_round:
            log.warning("%s: resumed from round %d while the coordinator is at round %d; not an exact resume", island.state.island_id, step, prefer_round)
        log.info("%s group %d rank %d resumed from %s (round %d)", island.state.island_id, island.spec.group, self.world.rank, self.store.step_url(step), step)
        return step
