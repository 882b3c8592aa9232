"""What `diloco-eval` does once its arguments are checked (diloco/cli/eval.py says what it takes): load a
coordinator checkpoint (one process's or a sharded coordinator's, its run's config checked against the digest
it records) or an exported Hugging Face folder into our model, choose the held-out data and the tokenizer,
and measure (diloco/models/evaluation.py)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
import torch.nn as nn

from diloco.checkpoint import CheckpointError, CheckpointStore
from diloco.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    _apply_override,
    config_from_dict,
    load_config,
)
from diloco.data.shards import DataError
from diloco.data.sources import eval_batches, resolve_vocab, text_eval_batches
from diloco.models.evaluation import (
    ByteTokenizer,
    EvalError,
    HFTokenizer,
    Tokenizer,
    check_vocab,
    corpus_tokenizer,
    heldout_loss,
    load_hellaswag,
    multiple_choice,
)
from diloco.shardmap import load_sharded, shards_under

_STEP_DIR = re.compile(r"^(?P<root>.*)/step-(?P<step>\d{10})$")
_STEP_NAME = re.compile(r"step-\d{10}$")
BYTE_VOCAB = 256  # a model of exactly this vocabulary and no tokenizer is taken to be byte-level


@dataclass
class Loaded:
    model: nn.Module
    cfg: RunConfig  # its model section is the model's; the rest the run's (when known_run) or the default
    kind: str  # "checkpoint" or "folder"
    step: int | None = None
    round: int | None = None
    tokenizer_url: str = ""  # an exported folder's tokenizer.json
    known_run: bool = True  # cfg is the run's: its held-out data and eval settings are the defaults



def load_source(args: argparse.Namespace) -> Loaded:
    url = args.source.rstrip("/")
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isfile(f"{path.rstrip('/')}/config.json"):
        return load_folder(args, url, fs, path)
    return load_checkpoint(args, url)


def load_checkpoint(args: argparse.Namespace, url: str) -> Loaded:
    m = _STEP_DIR.match(url)
    root, step = (m["root"], int(m["step"])) if m else (url, None)
    store = CheckpointStore(root)
    store.progress = sys.stderr.isatty()
    if not store.fs.exists(store.root):
        raise EvalError(f"no checkpoint at {url}: nothing there")
    try:
        shards = shards_under(root)
        if shards:  # a sharded coordinator's: its shards' parts put back together
            step, tensors, meta = load_sharded(root, shards, step)
            return _loaded(args, url, root, tensors, meta)
    except (CheckpointError, OSError, ValueError) as e:
        raise EvalError(str(e)) from None
    committed = store.steps()
    if step is None and not committed:
        folders = [e for e in store.fs.ls(store.root, detail=False) if _STEP_NAME.search(e.rstrip("/"))]
        if folders:
            raise EvalError(f"no committed checkpoint under {url}: {len(folders)} step folder(s), none committed "
                            "(torn by a crash, or still being written)")
        raise EvalError(f"no checkpoint at {url}: no step-NNNNNNNNNN folders (a coordinator's checkpoint.url) "
                        "and no config.json (an exported folder)")
    if step is not None and step not in committed:
        raise EvalError(f"checkpoint {step} under {root} is not committed (torn by a crash, or still being written)")
    try:
        tensors, meta = store.load(step)
    except KeyError:  # a folder step's marker lists files, not one state.pt
        raise EvalError(f"{url}: not a coordinator checkpoint (an island's torch.distributed checkpoint?)") from None
    return _loaded(args, url, root, tensors, meta)


def _loaded(args: argparse.Namespace, url: str, root: str, tensors: Any, meta: dict[str, Any]) -> Loaded:
    params = tensors.get("outer_params") if isinstance(tensors, dict) else None
    if not params or "config_digest" not in meta:
        raise EvalError(f"{url}: not a coordinator checkpoint (it holds no outer_params)")
    cfg = checkpoint_config(args, meta, f"checkpoint {meta['step']} under {root}")
    # The published copy is what the islands hold and the coordinator's eval loss measures (diloco-export
    # takes it too); it differs from the outer parameters only with a lossy downlink, else it is left empty.
    params = {**params, **(tensors.get("published") or {})}
    return Loaded(build_model(cfg.model, params, url), cfg, "checkpoint", int(meta["step"]), int(meta["round"]))


def checkpoint_config(args: argparse.Namespace, meta: dict[str, Any], where: str) -> RunConfig:
    """The run's config, checked against the digest the checkpoint records."""
    if args.config is None and meta.get("config_toml"):  # written since diloco-export (coordinator/durable.py)
        raw = tomllib.loads(meta["config_toml"])
        for item in args.overrides:
            _apply_override(raw, item)  # --set on top of the held config, as load_config applies it to a file's
        cfg, given = config_from_dict(raw), "the config it holds" + (" with --set" if args.overrides else "")
        hint = "--set may change only what the digest leaves out (eval, rounds, checkpoint, data.cache_dir, ...)"
    else:
        cfg = load_config(args.config, args.overrides)
        given = f"--config {args.config}" if args.config else "the default config"
        given += " with --set" if args.overrides else ""
        hint = "pass the run's --config and its --set overrides"
    if cfg.model.vocab_size == 0:  # a token run's: the corpus's, as the coordinator resolved it before hashing
        try:
            resolve_vocab(cfg)
        except (ConfigError, DataError) as e:
            raise EvalError(f"model.vocab_size = 0 is the run's corpus's, which cannot be read ({' '.join(str(e).split())}); "
                            "pass --set model.vocab_size=N") from None
    if cfg.digest() != meta["config_digest"]:
        raise EvalError(f"{where} is of a run whose config digest is {meta['config_digest']}; {given} gives "
                        f"{cfg.digest()}: {hint}")
    return cfg


def load_folder(args: argparse.Namespace, url: str, fs, path: str) -> Loaded:
    if importlib.util.find_spec("diloco.models.hf") is None:
        raise EvalError(f"{url} is an exported Hugging Face folder (config.json), and reading one needs "
                        "diloco/models/hf.py (from_hf_folder), which this install lacks")
    from diloco.models.hf import (  # lazily: it pulls in safetensors, which checkpoints do not need
        RUN_CONFIG,
        from_hf_folder,
    )

    try:
        model_cfg, params = from_hf_folder(url)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EvalError(f"{url}: cannot read the exported model ({' '.join(str(e).split())})") from None
    if not isinstance(model_cfg, ModelConfig):
        raise EvalError(f"{url}: from_hf_folder gave a {type(model_cfg).__name__}, not a ModelConfig")
    run_toml = f"{path.rstrip('/')}/{RUN_CONFIG}"
    known_run = args.config is None and fs.isfile(run_toml)
    if known_run:  # written by diloco-export since it carries the run's eval settings
        raw = tomllib.loads(fs.cat_file(run_toml).decode())
        for item in args.overrides:
            _apply_override(raw, item)
        cfg = config_from_dict(raw)
    else:
        cfg = load_config(args.config, args.overrides)
    cfg.model = model_cfg
    tokenizer = f"{path.rstrip('/')}/tokenizer.json"
    return Loaded(build_model(model_cfg, params, url), cfg, "folder",
                  tokenizer_url=fs.unstrip_protocol(tokenizer) if fs.isfile(tokenizer) else "", known_run=known_run)


def build_model(model_cfg: ModelConfig, params: dict[str, torch.Tensor], where: str) -> nn.Module:
    from diloco.models.llama import Transformer

    model = Transformer(model_cfg)
    try:
        model.load_state_dict(params)  # strict: parameters of another shape or name are another model
    except RuntimeError as e:
        raise EvalError(f"{where}: its parameters do not fit the model config ({' '.join(str(e).split())[:300]})") from None
    return model


# --- the figures ----------------------------------------------------------------------


def heldout_data(args: argparse.Namespace, loaded: Loaded, seq_len: int) -> tuple[Any, str, Tokenizer | None] | None:
    """(DataConfig, description, tokenizer) of the held-out set to use, or None for none. The tokenizer is
    None where the data is the model's own tokens: a token corpus, or bytes for a byte-level model."""
    data = dataclasses.replace(loaded.cfg.data, seq_len=seq_len)
    tokenizer: Tokenizer | None = None
    if args.text:
        if not Path(args.text).is_file():
            raise EvalError(f"text file not found: {args.text}")
        data = dataclasses.replace(data, source="text", path=args.text)
        tokenizer = pick_tokenizer(args, loaded, "--text")
        check_vocab(tokenizer, loaded.cfg.model.vocab_size)
    elif args.tokens:
        data = dataclasses.replace(data, source="tokens", url=args.tokens)
    elif not loaded.known_run:
        return None  # an exported model that does not say what it was trained on
    if data.source == "text":
        what = f"text {data.path} (its last {data.eval_fraction:.0%}"
        if tokenizer is None or isinstance(tokenizer, ByteTokenizer):  # bytes: read exactly as a text run reads them
            if loaded.cfg.model.vocab_size < BYTE_VOCAB:
                raise EvalError(f"byte-level text needs a model vocabulary of 256 or more; this one has "
                                f"{loaded.cfg.model.vocab_size}")
            return data, what + ")", None
        return data, f"{what}, tokenized by {tokenizer.name})", tokenizer
    if data.source == "tokens":
        return data, f"tokens {data.url} (eval split)", None
    return data, f"the synthetic language (seed {data.synthetic_seed})", None


def pick_tokenizer(args: argparse.Namespace, loaded: Loaded, purpose: str) -> Tokenizer:
    """The tokenizer that turns text into the model's tokens, for purpose (the flag that needs it)."""
    if args.tokenizer == "bytes":
        return ByteTokenizer()
    if args.tokenizer:
        return HFTokenizer.from_url(args.tokenizer)
    if args.tokens:
        return corpus_tokenizer(args.tokens)
    if loaded.tokenizer_url:
        return HFTokenizer.from_url(loaded.tokenizer_url)
    run = loaded.cfg.data if loaded.known_run else None  # else a folder's data section is not its run's
    if run is not None and run.source == "tokens":
        try:
            return corpus_tokenizer(run.url)
        except EvalError as e:
            raise EvalError(f"{purpose} needs the model's tokenizer, its run's corpus's: {e}; pass --tokenizer FILE "
                            "(the tokenizer.json it was trained with)") from None
    if (run is not None and run.source == "text") or loaded.cfg.model.vocab_size == BYTE_VOCAB:
        return ByteTokenizer()
    # Reading text as bytes for a model of another vocabulary scores ids it never saw as those tokens.
    has = ("its run trained on the synthetic language, which has no tokenizer" if run is not None
           else "the folder has no tokenizer.json")
    raise EvalError(f"{purpose} needs the model's tokenizer and none was found: {has}, and its vocabulary of "
                    f"{loaded.cfg.model.vocab_size} tokens is not bytes ({BYTE_VOCAB}); pass --tokenizer FILE (the "
                    "tokenizer.json it was trained with), or --tokenizer bytes for a model trained on bytes")


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_source(args)
    cfg = loaded.cfg
    model = loaded.model.to(device)
    max_len = cfg.model.max_seq_len
    seq_len = args.seq_len or (cfg.data.seq_len if loaded.known_run else max_len)
    if seq_len > max_len:
        raise EvalError(f"--seq-len {seq_len} exceeds the model's max_seq_len of {max_len}")
    batch_size = args.batch_size or cfg.eval.batch_size
    report: dict[str, Any] = {
        "source": args.source, "kind": loaded.kind, "step": loaded.step, "round": loaded.round,
        "parameters": sum(p.numel() for p in model.parameters()), "device": str(device), "heldout": None, "hellaswag": None,
    }
    n_batches = args.batches if args.batches is not None else (cfg.eval.batches or 8)
    chosen = heldout_data(args, loaded, seq_len) if n_batches > 0 else None
    if chosen is not None:
        data, description, text_tokenizer = chosen
        try:
            if text_tokenizer is not None:
                batches = text_eval_batches(data, text_tokenizer, n_batches, batch_size)
            else:
                batches = eval_batches(data, n_batches, batch_size, cfg.model.vocab_size)
        except ValueError as e:  # ConfigError and DataError are ValueErrors too: say which data, and the way out
            raise EvalError(f"held-out data {description}: {' '.join(str(e).split())} (--batches 0 skips the "
                            "held-out loss)") from None
        loss, perplexity, tokens = heldout_loss(model, batches, device)
        report["heldout"] = {"data": description, "batches": n_batches, "batch_size": batch_size, "seq_len": seq_len,
                             "loss": loss, "perplexity": perplexity, "tokens": tokens}
    if args.hellaswag:
        examples = load_hellaswag(args.hellaswag, args.limit)
        tokenizer = pick_tokenizer(args, loaded, "--hellaswag")
        check_vocab(tokenizer, cfg.model.vocab_size)
        scores = multiple_choice(model, tokenizer, examples, batch_size, device)
        report["hellaswag"] = {"file": args.hellaswag, "tokenizer": tokenizer.name, **scores}
    return report
