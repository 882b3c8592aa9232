from __future__ import annotations

from pathlib import Path

import pytest

from diloco.config import ConfigError, RunConfig, config_from_toml, load_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_embedded_default_is_the_tiny_demo():
    cfg = load_config(None)
    assert cfg == RunConfig()
    assert cfg.outer.lr == 0.7 and cfg.outer.momentum == 0.9 and cfg.outer.nesterov


def test_overrides_parse_toml_values():
    cfg = load_config(None, ["inner.lr=1e-3", "outer.nesterov=false", "name=x", "inner.betas=[0.8, 0.9]"])
    assert cfg.inner.lr == 1e-3 and cfg.outer.nesterov is False and cfg.name == "x" and cfg.inner.betas == [0.8, 0.9]


def test_toml_round_trip_and_digest():
    cfg = load_config(None, ["inner.lr=1e-3"])
    assert config_from_toml(cfg.to_toml()) == cfg
    assert cfg.digest() == config_from_toml(cfg.to_toml()).digest()
    assert cfg.digest() != load_config(None).digest()
    # Timing knobs are the coordinator's own and do not change the digest.
    assert load_config(None, ["rounds.deadline_s=5"]).digest() == load_config(None).digest()


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.n_heads=3", "divisible"),
        ("outer.momentum=1.5", "outer.momentum"),
        ("data.source='s3'", "data.source"),
        ("rounds.min_islands=0", "min_islands"),
        ("limits.spool_memory_models=-1", "limits.spool_memory_models >= 0"),
        ("limits.receive_window_mb=-1", "limits.receive_window_mb >= 0"),
        ("limits.push_slots=-1", "limits.push_slots >= 0"),
        ("robust.direction_cosine=1.0", r"robust.direction_cosine must be in \[-1, 1\)"),
        ("robust.direction_cosine=-1.5", r"robust.direction_cosine must be in \[-1, 1\)"),
        ("robust.first_quorum=0", "robust.first_quorum >= 1"),
        ("nosuchsection.x=1", "unknown key"),
        ("inner", "section.key=value"),
    ],
)
def test_bad_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["wire.codec='int8'", "wire.feedback_in_model=true"], "needs error feedback"),
        (["wire.codec='topk'", "wire.topk_error_feedback=false", "wire.feedback_in_model=true"], "needs error feedback"),
        (["wire.codec='topk'", "wire.feedback_in_model=true", "streaming.fragments=2", "streaming.tau=1",
          "streaming.eager=true", "model.n_layers=2"], "streaming.eager"),
    ],
)
def test_feedback_in_model_needs_error_feedback_and_no_eager_updates(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["wire.codec='topk'", "wire.feedback_in_model=true"]).wire.feedback_in_model


def test_shipped_configs_load():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        load_config(path)


def test_feedback_decay_defaults_to_a_quarter_for_topk_and_one_otherwise():
    assert load_config(None, ["wire.codec='topk+zstd'"]).wire.decay == 0.25
    assert load_config(None, ["wire.codec='int8'", "wire.error_feedback=true"]).wire.decay == 1.0
    assert load_config(None, ["wire.codec='topk'", "wire.feedback_decay=0.9"]).wire.decay == 0.9
    assert load_config(None, ["wire.codec='topk'", "wire.feedback_in_model=true"]).wire.decay == 1.0
    with pytest.raises(ConfigError, match="feedback_decay"):
        load_config(None, ["wire.feedback_decay=0"])


def test_the_coordinator_bounds_each_incoming_streams_receive_window():
    """limits.receive_window_mb fixes the HTTP/2 window (gRPC's probing would grow it towards whole pushes on busy
    cores); 0 leaves gRPC's probing."""
    from coordinator.server import server_options
    options = dict(server_options(load_config(None)))
    assert options["grpc.http2.lookahead_bytes"] == 32 * 2**20 and options["grpc.http2.bdp_probe"] == 0
    options = dict(server_options(load_config(None, ["limits.receive_window_mb=0"])))
    assert "grpc.http2.lookahead_bytes" not in options and "grpc.http2.bdp_probe" not in options


@pytest.mark.parametrize("overrides, message", [
    (["data.url=s3://bucket/corpus"], "data.url has no effect with data.source = 'synthetic'; set data.source = 'tokens'"),
    (["data.source='text'", "data.path='x.txt'", "model.vocab_size=256", "data.synthetic_seed=7"],
     "data.synthetic_seed has no effect with data.source = 'text'; set data.source = 'synthetic'"),
    (["inner.muon_lr=0.5"], "inner.muon_lr has no effect with inner.optimizer = 'adamw'; set inner.optimizer = 'muon'"),
    (["model.moe_top_k=2"], "model.moe_top_k has no effect with model.moe_experts = 0; set model.moe_experts = 2 or more"),
    (["rounds.round_s=2.0"], "rounds.round_s has no effect with rounds.mode = 'steps'; set rounds.mode = 'time'"),
])
def test_a_set_key_that_has_no_effect_in_the_config_is_an_error_naming_why(overrides, message):
    # It was silently ignored: the run trained on something other than what the command line asked for.
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.toml", overrides)
    assert str(e.value).startswith(message), str(e.value)


def test_a_set_key_acts_once_its_source_or_mode_is_set_too_in_either_order():
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["data.url='/corpus'", "data.source='tokens'", "model.vocab_size=0"])
    assert cfg.data.url == "/corpus"
    assert load_config(None, ["rounds.round_s=2.0", "rounds.mode='time'"]).rounds.round_s == 2.0
    # Only what --set asks is checked: a config file may carry every key of every source.
    assert load_config(ROOT / "configs" / "tiny.toml").data.synthetic_seed == 1234
