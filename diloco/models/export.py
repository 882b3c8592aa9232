"""A coordinator checkpoint as a Hugging Face model folder (`diloco-export`).

From the newest committed coordinator checkpoint (or --step N) under a CheckpointStore URL, local or
s3://, it writes a folder that transformers loads as LlamaForCausalLM:

    config.json                       diloco/models/hf.py's hf_config
    model.safetensors                 the global parameters, or, above shard_bytes,
    model-0000k-of-0000n.safetensors  shards and model.safetensors.index.json
    generation_config.json
    tokenizer.json, tokenizer_config.json, special_tokens_map.json   runs on a token corpus only
    diloco_run.toml                   the run's config: diloco-eval evaluates the folder as it did the run
    README.md                         a model card: the run's config and figures

The folder is written beside the target under a temporary name and renamed into place, so a crash
leaves no half-written model where a reader would look. Everything wrong with the input is an
ExportError whose one-line message says what and what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.checkpoint import CheckpointError, CheckpointStore
from diloco.config import ConfigError, RunConfig, config_from_toml, load_config
from diloco.models.hf import INDEX, RUN_CONFIG, WEIGHTS, HFError, hf_config, to_hf
from diloco.shardmap import load_sharded, shards_under

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARD_BYTES = 5 * 10**9  # transformers' own default max_shard_size, "5GB"


class ExportError(ValueError):
    """A checkpoint or folder that cannot be exported as asked; the message says why and what to do."""


@dataclass
class Exported:
    step: int
    folder: Path
    files: list[str] = field(default_factory=list)
    parameters: int = 0


@dataclass
class Tokenizer:
    """The run's tokenizer: the corpus's tokenizer.json and its end-of-document token."""

    data: bytes
    eos_token: str
    eos_id: int


def export(checkpoint_url: str, out_dir: str | Path, *, step: int | None = None, shard_bytes: int = SHARD_BYTES,
           force: bool = False, config_path: str | None = None, corpus_url: str | None = None,
           dtype: str = "float32", storage_options: dict | None = None) -> Exported:
    """Exports one committed coordinator checkpoint (default: the newest) to out_dir."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out} exists and is not an empty folder: choose another, or pass --force to replace it")
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    store = CheckpointStore(checkpoint_url, storage_options=storage_options)
    step, tensors, meta = _read_checkpoint(store, step, storage_options)
    cfg = _run_config(meta, tensors["outer_params"], config_path, f"checkpoint {step} under {store.url}")
    if cfg.model.moe_experts:
        raise ExportError(f"checkpoint {step} under {store.url} is a mixture of experts (model.moe_experts="
                          f"{cfg.model.moe_experts}): diloco-export writes dense Llama only, and Hugging Face's Mixtral has no "
                          "expert capacity, so its logits would differ wherever tokens overflow an expert")
    # The published copy is what every island holds and what the eval loss was measured on; it differs
    # from the outer parameters only with a lossy downlink (otherwise the checkpoint leaves it empty).
    params = {**tensors["outer_params"], **(tensors.get("published") or {})}
    try:
        weights = to_hf(params, cfg.model)
    except HFError as e:
        raise ExportError(f"checkpoint {step} under {store.url} does not fit its run config: {e}") from None
    tokenizer = _tokenizer(cfg, corpus_url, storage_options) if cfg.data.source == "tokens" else None
    eos = tokenizer.eos_id if tokenizer else None
    # Every document follows the previous one's end token, so it also starts one (as GPT-2's).
    config = hf_config(cfg.model, eos_id=eos, bos_id=eos, dtype=dtype)
    card = model_card(cfg, meta, step, store.url, sum(t.numel() for t in params.values()), dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json",
                    {"_from_model_config": True, **{k: v for k, v in (("bos_token_id", eos), ("eos_token_id", eos)) if v is not None}})
        files = write_weights(tmp, weights, shard_bytes, DTYPES[dtype])
        if tokenizer is not None:
            write_tokenizer(tmp, tokenizer, cfg.model.max_seq_len)
        (tmp / "README.md").write_text(card)
        (tmp / RUN_CONFIG).write_text(cfg.to_toml())
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported checkpoint %d of %s to %s (%d files)", step, store.url, out, len(files))
    return Exported(step, out, sorted(p.name for p in out.iterdir()), sum(t.numel() for t in params.values()))


def _read_checkpoint(store: CheckpointStore, step: int | None,
                     storage_options: dict | None = None) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(step, tensors, meta) of a committed coordinator checkpoint that matches its commit marker; a sharded
    coordinator's (shard-I-of-K folders) put back together at the newest step every shard committed."""
    try:
        shards = shards_under(store.url, storage_options)
        if shards:
            return load_sharded(store.url, shards, step, storage_options)
    except (CheckpointError, OSError, RuntimeError, ValueError) as e:
        raise ExportError(str(e)) from None
    committed = store.steps()
    if step is None:
        if not committed:
            torn = store._all_steps()
            raise ExportError(f"no committed checkpoint under {store.url}"
                              + (f" (steps {torn} are torn: their commit marker was never written)" if torn else "")
                              + "; give the URL of a run's checkpoint.url")
        step = committed[-1]
    elif step not in committed:
        raise ExportError(f"checkpoint {step} under {store.url} is not committed (missing, or torn by a crash); "
                          f"committed steps: {committed or 'none'}")
    earlier = [s for s in committed if s < step]
    hint = f"; export an earlier one with --step {earlier[-1]}" if earlier else ""
    if not store.fs.exists(f"{store.root}/step-{step:010d}/state.pt"):
        raise ExportError(f"checkpoint {step} under {store.url} is not a coordinator checkpoint (no state.pt: an "
                          "island's?); give the coordinator's checkpoint.url")
    try:
        tensors, meta = store.load(step)
    except (CheckpointError, OSError, RuntimeError, ValueError) as e:
        raise ExportError(f"{e}{hint}") from None
    if not isinstance(tensors, dict) or "outer_params" not in tensors:
        raise ExportError(f"checkpoint {step} under {store.url} holds no global parameters (outer_params): it is not "
                          "a coordinator checkpoint; give the coordinator's checkpoint.url")
    return step, tensors, meta


def _run_config(meta: Mapping[str, Any], params: Mapping[str, torch.Tensor], config_path: str | None,
                where: str) -> RunConfig:
    """The run's config: the checkpoint's own, else the file given, which must be the run's (same digest)."""
    try:
        if config_path is not None:
            cfg = load_config(config_path)
        elif meta.get("config_toml"):
            cfg = config_from_toml(meta["config_toml"])
        else:
            raise ExportError(f"{where} does not record its run config (written before diloco-export): pass --config "
                              "RUN.toml, the config the run was started with")
    except ConfigError as e:
        raise ExportError(f"the run config: {e}") from None
    if cfg.model.vocab_size == 0 and "embed.weight" in params:
        cfg.model.vocab_size = params["embed.weight"].shape[0]  # taken from the corpus, as the run did
    if config_path is not None and meta.get("config_digest") not in (None, cfg.digest()):
        raise ExportError(f"--config {config_path} is not the config of {where} (digest {cfg.digest()}, the "
                          f"checkpoint's {meta['config_digest']}); pass the config the run was started with")
    return cfg


def _tokenizer(cfg: RunConfig, corpus_url: str | None, storage_options: dict | None) -> Tokenizer | None:
    """The corpus's tokenizer (None for an MDS dataset, which names none)."""
    import fsspec

    from diloco.data.shards import MANIFEST, DataError, read_manifest

    url = (corpus_url or cfg.data.url).rstrip("/")
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        if not fs.exists(f"{root}/{MANIFEST}") and fs.exists(f"{root}/index.json"):
            log.warning("the run's corpus %s is an MDS dataset, which names no tokenizer: exporting without one", url)
            return None
        manifest, _ = read_manifest(url, storage_options)
        data = fs.cat_file(f"{root}/{manifest.tokenizer_file}")
    except (DataError, OSError) as e:
        raise ExportError(f"the run's corpus {url} (for its tokenizer) cannot be read: {e}; run from where the run "
                          "ran, or pass --corpus URL") from None
    if hashlib.sha256(data).hexdigest() != manifest.tokenizer_sha256:
        raise ExportError(f"{url}/{manifest.tokenizer_file} does not match the sha256 its manifest records")
    return Tokenizer(data, manifest.eos_token, manifest.eos_id)


def write_weights(folder: Path, weights: Mapping[str, torch.Tensor], shard_bytes: int, dtype: torch.dtype) -> list[str]:
    """model.safetensors, or shards of at most shard_bytes (a tensor larger than that alone in one) and
    model.safetensors.index.json, named as transformers' save_pretrained names them."""
    from safetensors.torch import save_file

    size = torch.finfo(dtype).bits // 8
    shards: list[list[str]] = [[]]
    filled = 0
    for name, t in weights.items():
        n = t.numel() * size
        if shards[-1] and filled + n > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += n
    total = sum(t.numel() for t in weights.values()) * size
    files = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, names in zip(files, shards):
        # One shard at a time in the export dtype: the copies never hold more than one shard.
        save_file({n: weights[n].to(dtype).contiguous() for n in names}, str(folder / file), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
        _write_json(folder / INDEX, index)
        files.append(INDEX)
    return files


def write_tokenizer(folder: Path, tokenizer: Tokenizer, max_len: int) -> None:
    """tokenizer.json as the corpus has it, and the two small files AutoTokenizer reads beside it."""
    (folder / "tokenizer.json").write_bytes(tokenizer.data)
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
        "eos_token": tokenizer.eos_token, "bos_token": tokenizer.eos_token,
        "clean_up_tokenization_spaces": False,
    })
    _write_json(folder / "special_tokens_map.json", {"eos_token": tokenizer.eos_token, "bos_token": tokenizer.eos_token})


def run_figures(meta: Mapping[str, Any]) -> dict[str, Any]:
    """What the checkpoint's metadata says of the run: rounds, tokens, losses, islands."""
    summaries = meta.get("summaries") or []
    # Each fragment's round counts the tokens trained since that fragment last synced: fragment 0's
    # rounds count every token once (protobuf's JSON leaves fragment 0 and int64s as strings out/in).
    main = [s for s in summaries if int(s.get("fragment", 0)) == 0]
    evals = [(int(s.get("round", 0)), float(s["evalLoss"])) for s in main if "evalLoss" in s]
    evals = [(r, v) for r, v in evals if math.isfinite(v)]
    initial = meta.get("initial_eval_loss")
    return {
        "round": meta.get("round"), "finished": bool(meta.get("finished")),
        "tokens": sum(int(s.get("tokens", 0)) for s in main),
        "eval_loss": evals[-1] if evals else None,
        "initial_eval_loss": initial if isinstance(initial, (int, float)) and math.isfinite(initial) else None,
        "islands": sorted({i for s in main for i in s.get("islands", [])}),
        "checksum": meta.get("checksum"), "wall_time": meta.get("wall_time"),
    }


def model_card(cfg: RunConfig, meta: Mapping[str, Any], step: int, url: str, n_params: int, dtype: str) -> str:
    m, f = cfg.model, run_figures(meta)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(f["wall_time"]))) if f["wall_time"] else "unknown"
    rows = [
        ("parameters", f"{n_params / 1e6:.2f}M ({dtype})"),
        ("shape", f"{m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads ({m.kv_heads} key/value), "
                  f"SwiGLU {m.d_ff}, vocabulary {m.vocab_size}, {'tied' if m.tie_embeddings else 'untied'} embeddings"),
        ("context", f"{m.max_seq_len} tokens (RoPE theta {m.rope_theta:g})"),
        ("data", {"tokens": f"token corpus {cfg.data.url}", "text": f"bytes of {cfg.data.path}"}.get(cfg.data.source, cfg.data.source)),
        ("rounds closed", f"{f['round']} of {cfg.rounds.rounds} ({'finished' if f['finished'] else 'in progress'}), "
                          f"H = {cfg.inner.steps_per_round} inner steps"),
        ("islands", f"{len(f['islands'])} contributed"),
        ("tokens trained", f"{f['tokens']:,}"),
        ("eval loss", f"{f['eval_loss'][1]:.4f} after round {f['eval_loss'][0]}" if f["eval_loss"] else "not evaluated"),
        ("eval loss at start", f"{f['initial_eval_loss']:.4f}" if f["initial_eval_loss"] is not None else "not evaluated"),
        ("checkpoint", f"step {step} of {url}, written {when}; parameter checksum {f['checksum']}"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [llama, diloco]
---

# {cfg.name}

A Llama-architecture decoder trained with DiLoCo across islands (this project's `diloco`), exported by
`diloco-export` from the coordinator's global parameters. Not instruction-tuned.

| | |
|---|---|
{table}

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")
```

## Run config

```toml
{cfg.to_toml().strip()}
```
"""


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _replace(tmp: Path, out: Path) -> None:
    """Moves the finished folder to out, replacing what is there (the caller checked it may)."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
