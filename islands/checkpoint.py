"""Island checkpoints with torch.distributed.checkpoint (DCP), on any fsspec URL, for every island kind.

Saved at the top of a step with no exchange in flight (so no network state),
every --checkpoint-every rounds over all fragments, by the replica group that
is rank 0 of that step's quorum (all groups hold the same state; the others
wait in the step's collectives, so a save must fit in --ft-timeout):

- the model and the inner optimizer's state (get_model_state_dict,
  get_optimizer_state_dict: DTensors on a sharded island, plain tensors on a
  one-rank island);
- the rank's shard of theta_global, the error-feedback residual and, with
  eager updates, each fragment's momentum replica and last mean and own
  pseudo-gradient, wrapped as DTensors placed like their parameters (the flat
  shard viewed in the parameter's local shape): the checkpoint holds whole
  logical tensors and reloads into any number of ranks (DCP reshards);
- each rank's RNG states (nothing random is drawn today: batches are a pure
  function of the inner step; a guard for later changes);
- meta.json: the island's id and key, its IslandState, the config digest.

Commit rule (CheckpointStore's folder steps): rank 0 of the saving group
empties step-NNNNNNNNNN/, every rank writes its DCP files, then rank 0 writes
meta.json and last the COMMITTED marker listing every file and its size. A step
without it, or whose files differ from it, is never loaded; if the saving group
dies mid-save the step is redone and the next rank-0 group saves it again.
The step is the rounds landed over all fragments (the round without
streaming), as the coordinator names its own.
"""

from __future__ import annotations

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
from diloco.progress import WORTH_SHOWING, Progress
from islands.context import IslandContext

log = logging.getLogger(__name__)


def _as_dtensors(model: torch.nn.Module, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-rank shards (flat, or shaped on a one-rank island) as tensors placed like their parameters.

    On a CPU mesh these are views of the shards (DCP reads into them in place);
    on a GPU mesh from_local copies each to the GPU for the save.
    """
    out = {}
    for name, p in model.named_parameters():
        if name not in flat:
            continue
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
                flat[name].view(-1).copy_(local.reshape(-1))


def _eager_tensors(ctx: IslandContext, present: list[list[str]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Each fragment's eager memory as {key: {name: shard}}; present (from a checkpoint's meta) names what to allocate."""
    out = {}
    for f, e in enumerate(ctx.eager or []):
        shard = ctx.fragments[f]
        have = {"momentum": e.replica.buffers, "prev_mean": e.prev_mean, "prev_own": e.prev_own}
        for key, tensors in have.items():
            if present is not None:
                if key not in present[f]:
                    continue
                tensors = {r.name: torch.zeros(r.numel) for r in shard.ranges}
            if tensors is not None:
                out[f"eager{f}.{key}"] = tensors
    return out


class IslandCheckpoint:
    """One island's checkpoints under url: written by one replica group, read by every group on --resume."""

    def __init__(self, url: str, every: int, world, keep_last: int = 3):
        self.store = CheckpointStore(url, keep_last=keep_last)
        self.every = max(1, every)
        self.world = world
        self.last: int | None = None  # the step last saved or restored here (or the one this process started at)
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

    def _progress(self, ctx: IslandContext, label: str, saving: bool) -> Progress:
        """Elapsed time, then the size, on a terminal: on the saving group's rank 0, or group 0's on a restore."""
        large = 4 * self.world.world_size * sum(t.numel() for t in ctx.global_shard.values()) >= WORTH_SHOWING
        return Progress(label, enabled=large and self.world.is_leader and (saving or ctx.spec.group == 0))

    def _state(self, ctx: IslandContext, with_optimizer: bool, rng_ranks: int, eager: dict) -> dict:
        state = {"model": get_model_state_dict(ctx.model), "global": _as_dtensors(ctx.model, ctx.global_shard)}
        if with_optimizer:
            state["optimizer"] = get_optimizer_state_dict(ctx.model, ctx.optimizer)
        if ctx.feedback is not None:
            state["feedback"] = _as_dtensors(ctx.model, ctx.feedback.buffers)
        for key, tensors in eager.items():
            state[key] = _as_dtensors(ctx.model, tensors)
        if self.world.rank < rng_ranks:
            state[f"rng-rank{self.world.rank}"] = rng_state()
        return state

    # --- saving ------------------------------------------------------------------------

    def maybe_save(self, ctx: IslandContext) -> None:
        """Called at the top of a step with nothing in flight: saves if due and this group is the saver."""
        s = ctx.state
        step = sum(s.rounds)
        if self.last is None:
            self.last = step  # nothing trained here yet
        if step == self.last or step % (self.every * len(s.rounds)) or s.done():
            return
        if ctx.replicas.participating_rank() != 0:
            return
        self.save(ctx)

    def save(self, ctx: IslandContext) -> str:
        s, started = ctx.state, time.monotonic()
        step = sum(s.rounds)
        url = self._on_leader(lambda: self.store.begin_files(step))
        # get_optimizer_state_dict would initialise an empty optimizer (a fresh one after a divergence) by stepping it.
        with_optimizer = bool(ctx.optimizer.state)
        eager = _eager_tensors(ctx)
        progress = self._progress(ctx, f"writing checkpoint {step}", saving=True)
        try:  # DCP raises on every rank when any rank failed
            with progress.ticking():
                dcp.save(self._state(ctx, with_optimizer, self.world.world_size, eager),
                         storage_writer=FsspecWriter(url, sync_files=self.local))
        except CheckpointException as e:
            progress.close("failed")
            raise CheckpointError(f"could not write checkpoint {step} to {url}: {e}") from e
        meta = {
            "island_id": s.island_id, "island_key": ctx.spec.key, "round": s.round, "position": s.state_dict(),
            "config_digest": ctx.cfg.digest(), "format": "torch.distributed.checkpoint", "optimizer": with_optimizer,
            "world_size": self.world.world_size, "saved_by_group": ctx.spec.group, "replica_groups": ctx.spec.groups,
            "eager": [[k.split(".", 1)[1] for k in eager if k.startswith(f"eager{f}.")] for f in range(len(ctx.eager or []))],
            "eager_share": [e.share for e in ctx.eager or []], "wall_time": time.time(),
        }
        ctx.faults.hit("die-before-commit", s.round)  # tests: a torn save
        try:
            where = self._on_leader(lambda: self.store.commit_files(step, meta))
            if progress.shown:
                progress.set(self.store.step_bytes(step))
        finally:
            progress.close()
        self.last = step
        if self.world.is_leader:
            log.info("%s group %d: checkpoint of fragment rounds %s written to %s in %.2fs",
                     s.island_id, ctx.spec.group, s.rounds, where, time.monotonic() - started)
        return where

    # --- resuming ------------------------------------------------------------------------

    def choose(self, prefer_step: int | None = None) -> tuple[int, dict] | None:
        """(step, meta) to resume from: prefer_step's if committed and whole, else the newest that is; None if none."""
        def pick():
            if not self.store.steps():
                return None
            if prefer_step is not None and prefer_step in self.store.steps():
                try:
                    return self.store.load_files(prefer_step)
                except CheckpointError as e:
                    log.warning("skipping checkpoint: %s", e)
            return self.store.load_files()
        return self._on_leader(pick)

    def restore(self, ctx: IslandContext, prefer_step: int | None = None) -> int | None:
        """Loads a checkpoint into the island's parts (every rank of the group); returns its step, None if there is none.

        Taking the coordinator's step, not simply the newest, matters after a
        crash that caught the island a round ahead of the coordinator's last
        checkpoint. The island then fetches theta_global and resyncs every
        fragment whose round or checksum differs from the coordinator's.
        """
        chosen = self.choose(prefer_step)
        if chosen is None:
            log.warning("no committed checkpoint under %s; starting this island afresh", self.store.url)
            return None
        step, meta = chosen
        if meta["config_digest"] != ctx.cfg.digest():
            raise ValueError(f"island checkpoint at {self.store.url} is for another config ({meta['config_digest']})")
        eager = _eager_tensors(ctx, meta.get("eager") or [[] for _ in ctx.eager or []])
        state = self._state(ctx, meta["optimizer"], meta["world_size"], eager)
        progress = self._progress(ctx, f"reading checkpoint {step}", saving=False)
        try:
            with progress.ticking():
                dcp.load(state, storage_reader=FsspecReader(self.store.step_url(step)))
            if progress.shown:
                progress.set(self.store.step_bytes(step))
        except CheckpointException as e:
            raise CheckpointError(f"could not read checkpoint {step} under {self.store.url}: {e}") from e
        finally:
            progress.close()
        set_model_state_dict(ctx.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(ctx.model, ctx.optimizer, state["optimizer"])
        _copy_back(ctx.global_shard, state["global"])
        if ctx.feedback is not None and "feedback" in state:
            _copy_back(ctx.feedback.buffers, state["feedback"])
        for key, tensors in eager.items():
            _copy_back(tensors, state[key])
        for f, e in enumerate(ctx.eager or []):
            loaded = {k.split(".", 1)[1]: v for k, v in eager.items() if k.startswith(f"eager{f}.")}
            e.load_state_dict({"momentum": loaded.get("momentum", {}), "prev_mean": loaded.get("prev_mean"),
                               "prev_own": loaded.get("prev_own"), "share": meta["eager_share"][f]})
        if f"rng-rank{self.world.rank}" in state:
            set_rng_state(state[f"rng-rank{self.world.rank}"])
        ctx.state.load_state_dict(meta["position"])
        ctx.restored = True
        self.last = step
        if prefer_step is not None and step != prefer_step:
            log.warning("%s: resumed from step %d while the coordinator is at step %d; not an exact resume", ctx.island_id, step, prefer_step)
        log.info("%s group %d rank %d resumed from %s (step %d)", ctx.island_id, ctx.spec.group, self.world.rank,
                 self.store.step_url(step), step)
        return step
