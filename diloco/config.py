"""Run configuration: dataclasses loaded from TOML, with `section.key=value` overrides.

The defaults *are* the embedded demo: a ~1M-parameter model on a synthetic
language, so `diloco-sim` runs with no file and no download.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from diloco.policy import LimitsConfig, RobustConfig
from diloco.sections import (CheckpointConfig, DataConfig, EvalConfig, InnerConfig, ModelConfig, OuterConfig, RoundConfig,
                             StreamingConfig, WireConfig)

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "EvalConfig", "InnerConfig", "LimitsConfig", "ModelConfig",
           "OuterConfig", "RobustConfig", "RoundConfig", "RunConfig", "StreamingConfig", "WireConfig", "config_from_dict",
           "config_from_toml", "load_config"]


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says why."""


@dataclass
class RunConfig:
    name: str = "tiny-synthetic"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def digest(self) -> str:
        """Hash of everything islands and coordinator must agree on."""
        canonical = json.dumps(self._agreed(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differing_keys(self, other: RunConfig) -> list[tuple[str, Any, Any]]:
        """(section.key, ours, theirs) for each key the digest covers whose values differ: why two digests differ."""
        ours, theirs = _flat(self._agreed()), _flat(other._agreed())
        return [(k, ours.get(k), theirs.get(k)) for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]

    def _agreed(self) -> dict[str, Any]:
        """What the digest covers: everything islands and coordinator must agree on."""
        body = self.to_dict()
        # Membership and timing knobs are the coordinator's business.
        body.pop("rounds")
        body.pop("eval")
        body.pop("checkpoint")
        body.pop("robust")
        body.pop("limits")
        for local in ("cache_dir", "cache_gb", "prefetch_shards"):  # each machine's own
            body["data"].pop(local)
        if self.streaming == StreamingConfig():
            body.pop("streaming")  # plain DiLoCo hashes as it did before streaming existed
        if self.inner.optimizer != "muon":  # and without Muon, as before its settings existed
            body["inner"] = {k: v for k, v in body["inner"].items() if not k.startswith("muon_")}
        if not self.model.moe_experts:  # and a dense model, as before mixture-of-experts settings existed
            body["model"] = {k: v for k, v in body["model"].items() if not k.startswith("moe_")}
        if (self.inner.min_steps, self.inner.max_steps) == (1, 0):  # and with fixed rounds, as before step bounds existed
            body["inner"] = {k: v for k, v in body["inner"].items() if k not in ("min_steps", "max_steps")}
        if not self.wire.link_codecs:  # and with one codec for every link, as before per-link codecs existed
            body["wire"] = {k: v for k, v in body["wire"].items() if k not in ("link_codecs", "link_fraction")}
        if self.rounds.mode != "steps":  # every island must pace its rounds alike (the rest of [rounds] is not theirs)
            body["pace"] = {"mode": self.rounds.mode, "round_s": self.rounds.round_s}
        return body

    def validate(self) -> None:
        m, d, i, r = self.model, self.data, self.inner, self.rounds
        checks = [
            (m.d_model % m.n_heads == 0, "model.d_model must be divisible by model.n_heads"),
            ((m.d_model // max(m.n_heads, 1)) % 2 == 0, "model head dim must be even for RoPE"),
            (m.n_kv_heads >= 0 and m.n_heads % m.kv_heads == 0, "model.n_heads must be a multiple of model.n_kv_heads (0: n_heads)"),
            (m.moe_experts == 0 or (m.moe_experts >= 2 and 1 <= m.moe_top_k <= m.moe_experts and m.moe_capacity_factor > 0
                                    and m.moe_aux_loss_coef >= 0),
             "model.moe_experts must be 0 (dense) or >= 2, with 1 <= moe_top_k <= moe_experts, moe_capacity_factor > 0 "
             "and moe_aux_loss_coef >= 0"),
            (d.seq_len <= m.max_seq_len, "data.seq_len must not exceed model.max_seq_len"),
            (d.source in ("synthetic", "text", "tokens"), "data.source must be 'synthetic', 'text' or 'tokens'"),
            (d.source != "text" or bool(d.path), "data.source='text' needs data.path"),
            (d.source != "tokens" or bool(d.url), "data.source='tokens' needs data.url (a local path or s3:// URL of a "
             "dataset made by `diloco-data prepare`, or of an MDS dataset)"),
            (d.shuffle_block >= 1 and d.cache_gb > 0 and d.prefetch_shards >= 0,
             "need data.shuffle_block >= 1, data.cache_gb > 0 and data.prefetch_shards >= 0"),
            (m.vocab_size >= 1 or d.source == "tokens", "model.vocab_size must be >= 1 (0, from the corpus, only with data.source='tokens')"),
            (i.optimizer in ("adamw", "sgd", "muon"), "inner.optimizer must be 'adamw', 'sgd' or 'muon'"),
            (i.optimizer != "muon" or (i.lr > 0 and i.muon_lr >= 0 and 0 <= i.muon_momentum < 1 and 1 <= i.muon_ns_steps < 100
                                       and i.muon_adjust_lr in ("match_rms_adamw", "original")),
             "inner.optimizer='muon' needs inner.lr > 0, muon_lr >= 0, muon_momentum in [0, 1), muon_ns_steps in [1, 100) "
             "and muon_adjust_lr 'match_rms_adamw' or 'original'"),
            (i.schedule in ("cosine", "constant"), "inner.schedule must be 'cosine' or 'constant'"),
            (i.steps_per_round >= 1, "inner.steps_per_round must be >= 1"),
            (i.batch_size >= 1, "inner.batch_size must be >= 1"),
            (r.rounds >= 1, "rounds.rounds must be >= 1"),
            (r.mode in ("steps", "time"), "rounds.mode must be 'steps' or 'time'"),
            (r.mode != "time" or 0 < r.round_s < r.deadline_s, "rounds.mode='time' needs 0 < rounds.round_s < rounds.deadline_s"),
            (i.max_steps >= 0 and 1 <= i.min_steps <= (i.max_steps or i.steps_per_round),
             "need 1 <= inner.min_steps <= inner.max_steps (0: inner.steps_per_round)"),
            (r.late_rounds >= 0 and 0 <= r.late_discount <= 1, "need rounds.late_rounds >= 0 and 0 <= rounds.late_discount <= 1"),
            (r.late_mode in ("discount", "delayed_nesterov"), "rounds.late_mode must be 'discount' or 'delayed_nesterov'"),
            (0 < self.wire.link_fraction <= 1, "wire.link_fraction must be in (0, 1]"),
            (1 <= r.min_islands <= r.max_islands, "need 1 <= rounds.min_islands <= rounds.max_islands"),
            (self.outer.lr > 0, "outer.lr must be > 0"),
            (0 <= self.outer.momentum < 1, "outer.momentum must be in [0, 1)"),
            (1024 <= self.wire.chunk_bytes <= 3 << 20, "wire.chunk_bytes must be in [1 KiB, 3 MiB]"),
            (self.wire.feedback_decay == -1 or 0 < self.wire.feedback_decay <= 1,
             "wire.feedback_decay must be in (0, 1], or -1 (auto)"),
            (not self.wire.feedback_in_model or self.wire.uses_error_feedback,
             "wire.feedback_in_model keeps the error-feedback residual in the model: it needs error feedback "
             "(a topk codec, or wire.error_feedback = true)"),
            (not (self.wire.feedback_in_model and self.streaming.eager),
             "wire.feedback_in_model does not combine with streaming.eager; turn one of them off"),
            (self.checkpoint.every_rounds >= 1, "checkpoint.every_rounds must be >= 1"),
            (self.robust.norm_factor > 1 and self.robust.history >= 1 and self.robust.action in ("clip", "drop"),
             "robust.norm_factor must be > 1, robust.history >= 1 and robust.action 'clip' or 'drop'"),
            (-1 <= self.robust.direction_cosine < 1 and self.robust.first_quorum >= 1,
             "robust.direction_cosine must be in [-1, 1) and robust.first_quorum >= 1"),
            (self.checkpoint.keep_last >= 1, "checkpoint.keep_last must be >= 1"),
            (self.limits.valid(), "limits.*: every bound must be > 0 (limits.idle_rounds >= 0, limits.spool_memory_models >= 0, limits.receive_window_mb >= 0 and limits.push_slots >= 0: 0 turns them off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self._validate_streaming()
        if d.source == "synthetic" and m.vocab_size < d.synthetic_vocab:
            raise ConfigError("model.vocab_size must be >= data.synthetic_vocab")
        if d.source == "text" and m.vocab_size < 256:
            raise ConfigError("byte-level text needs model.vocab_size >= 256")

    def _validate_streaming(self) -> None:
        s, h = self.streaming, self.inner.steps_per_round
        checks = [
            (s.fragments >= 1, f"streaming.fragments must be >= 1, got {s.fragments}"),
            (s.fragments <= self.model.n_layers,
             f"streaming.fragments={s.fragments} exceeds model.n_layers={self.model.n_layers}: a fragment is a group of blocks"),
            (s.fragments <= h, f"streaming.fragments={s.fragments} exceeds inner.steps_per_round={h}: fragments need distinct offsets"),
            (s.pattern in ("strided", "sequential"), f"streaming.pattern must be 'strided' or 'sequential', got {s.pattern!r}"),
            (-1 <= s.tau < h, f"streaming.tau must be in [0, inner.steps_per_round={h}) or -1 (auto), got {s.tau}"),
            (0.0 <= s.alpha < 1.0, f"streaming.alpha must be in [0, 1), got {s.alpha}"),
            (not s.eager or s.overlap >= 1, "streaming.eager needs streaming.tau >= 1 (eager updates fill the overlap window)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def _flat(body: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"section.key": value} of a nested dict (the pace entry reads pace.mode, as it is hashed)."""
    flat: dict[str, Any] = {}
    for k, v in body.items():
        if isinstance(v, dict):
            flat.update(_flat(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    """Builds dataclass `cls` from a TOML table, rejecting unknown keys."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where or 'top level'}]; known: {sorted(known)}")
    kwargs = {}
    for name, value in raw.items():
        default = getattr(cls(), name)
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"[{name}] must be a table")
            kwargs[name] = _build(type(default), value, name)
        else:
            kwargs[name] = _coerce(value, default, f"{where + '.' if where else ''}{name}")
    return cls(**kwargs)


def _coerce(value: Any, default: Any, key: str) -> Any:
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(default, str):
        if isinstance(value, str):
            return value
    elif isinstance(default, list):
        if isinstance(value, list):
            return [_coerce(v, default[0], key) for v in value] if default else value
    raise ConfigError(f"{key} must be of type {type(default).__name__}, got {value!r}")


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    cfg = _build(RunConfig, raw, "")
    cfg.validate()
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Loads a TOML config (or the embedded default when path is None) and applies overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p} is not valid TOML: {e}") from e
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = config_from_dict(raw)
    check_overrides_act(cfg, overrides or [])
    return cfg


@dataclass(frozen=True)
class _ActsOnlyWith:
    """Keys (a trailing * matches a prefix) that act only when setting's value passes acts; wanted names such a value."""
    keys: tuple[str, ...]
    setting: str
    acts: Callable[[Any], bool]
    wanted: str


# Which keys matter only for which data source or mode. A --set of one of them in a config where it does nothing is
# an error, not a warning: the user asked for something on the command line that the run would not do (train on the
# synthetic language instead of their corpus, for hours), and a warning scrolls away among the run's logs.
_ACTS_ONLY_WITH = (
    _ActsOnlyWith(("data.url", "data.shuffle_block", "data.cache_dir", "data.cache_gb", "data.prefetch_shards"),
                  "data.source", lambda v: v == "tokens", "'tokens'"),
    _ActsOnlyWith(("data.stripe_bytes",), "data.source", lambda v: v == "text", "'text'"),
    _ActsOnlyWith(("data.synthetic_*",), "data.source", lambda v: v == "synthetic", "'synthetic'"),
    _ActsOnlyWith(("inner.muon_*",), "inner.optimizer", lambda v: v == "muon", "'muon'"),
    _ActsOnlyWith(("model.moe_top_k", "model.moe_capacity_factor", "model.moe_aux_loss_coef"),
                  "model.moe_experts", lambda v: v >= 2, "2 or more"),
    _ActsOnlyWith(("rounds.round_s",), "rounds.mode", lambda v: v == "time", "'time'"),
)


def _value_at(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_overrides_act(cfg: RunConfig, overrides: list[str]) -> None:
    """ConfigError naming the first override (section.key=value) that has no effect in cfg, and what would give it one."""
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        for rule in _ACTS_ONLY_WITH:
            if any(key == k or (k.endswith("*") and key.startswith(k[:-1])) for k in rule.keys):
                value = _value_at(cfg, rule.setting)
                if not rule.acts(value):
                    raise ConfigError(f"{key} has no effect with {rule.setting} = {value!r}; set {rule.setting} = "
                                      f"{rule.wanted} (or drop --set {key})")


def config_from_toml(text: str) -> RunConfig:
    return config_from_dict(tomllib.loads(text))


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Applies `section.key=value`; the value is parsed as a TOML value, else a string."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    table = raw
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item!r}: {part} is not a section")
    table[parts[-1]] = value
