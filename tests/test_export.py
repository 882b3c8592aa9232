"""`diloco-export`: a coordinator checkpoint as a Hugging Face Llama folder that transformers loads with our logits."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import fsspec
import pytest
import torch

from conftest import claim, tiny_config
from kit import coordinator_checkpoint, export_cli, one_error_line
from diloco.checkpoint import CheckpointStore
from diloco.models.hf import from_hf_folder
from diloco.models.llama import Transformer
from diloco.data.prepare import PrepareConfig, prepare

pytestmark = pytest.mark.integration

log = logging.getLogger(__name__)

MHA_TIED = ("model.n_layers=2",)
GQA_UNTIED = ("model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=96",
              "model.tie_embeddings=false", "model.rope_theta=500000.0", "model.norm_eps=1e-6",
              # A lossy downlink: the export is the published copy islands hold (and eval measured), not the outer one.
              "wire.downlink_codec='int8'")


def compare_with_transformers(folder, cfg, params) -> float:
    """Max |our logits - LlamaForCausalLM's| on random tokens, fp32."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ours = Transformer(cfg.model).eval()
    ours.load_state_dict(params)
    tokens = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    return diff


@pytest.mark.parametrize("variant", [MHA_TIED, GQA_UNTIED], ids=["tied-mha", "untied-gqa"])
def test_export_loads_in_transformers_with_our_logits(variant, make_coordinator, tmp_path, capsys):
    cfg, published = coordinator_checkpoint(make_coordinator, str(tmp_path / "ckpt"), *variant)
    assert export_cli(tmp_path / "ckpt", tmp_path / "hf") == 0
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["README.md", "config.json", "diloco_run.toml", "generation_config.json", "model.safetensors"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] == cfg.model.tie_embeddings and config["num_key_value_heads"] == cfg.model.kv_heads
    # The round trip gives back the config and exactly the published parameters.
    model_cfg, state = from_hf_folder(tmp_path / "hf")
    assert model_cfg == cfg.model
    assert state.keys() == published.keys() and all(torch.equal(state[n], t) for n, t in published.items())
    if cfg.wire.downlink_codec:  # lossy: what the islands hold differs from the outer parameters
        outer = CheckpointStore(str(tmp_path / "ckpt")).load()[0]["outer_params"]
        assert any(not torch.equal(outer[n], t) for n, t in published.items())
    diff = compare_with_transformers(tmp_path / "hf", cfg, state)
    log.warning("%s: max |logits diff| vs LlamaForCausalLM = %.3g", "+".join(variant), diff)
    assert diff < 1e-5
    card = (tmp_path / "hf" / "README.md").read_text()
    assert "## Run config" in card and cfg.to_toml().splitlines()[0] in card
    assert f"tokens trained | {claim(cfg)['tokens']:,} |" in card and "eval loss | " in card and "after round 0" in card


def test_a_large_model_is_sharded_with_an_index(make_coordinator, tmp_path):
    cfg, published = coordinator_checkpoint(make_coordinator, str(tmp_path / "ckpt"), *GQA_UNTIED, push=False)
    assert export_cli(tmp_path / "ckpt", tmp_path / "hf", "--shard-gb", 20e3 / 1e9) == 0  # 20 kB shards
    folder = tmp_path / "hf"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 3 and not (folder / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == 4 * sum(t.numel() for t in published.values())
    _, state = from_hf_folder(folder)
    assert compare_with_transformers(folder, cfg, state) < 1e-5


def test_a_token_run_exports_its_tokenizer(make_coordinator, tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"the river {i} runs past the stone island {i % 7}" for i in range(300)))
    corpus = str(tmp_path / "tokens")
    prepare(PrepareConfig([str(tmp_path / "corpus.txt")], corpus, vocab_size=300, eval_fraction=0.1, shard_tokens=4096, workers=1))
    cfg, _ = coordinator_checkpoint(
        make_coordinator, str(tmp_path / "ckpt"), "data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0",
        f"data.cache_dir={str(tmp_path / 'cache')!r}", "data.shuffle_block=8", push=False)
    assert export_cli(tmp_path / "ckpt", tmp_path / "hf") == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("the river 12 runs")["input_ids"]
    assert tokenizer.decode(ids) == "the river 12 runs" and tokenizer.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == 300 and config["eos_token_id"] == tokenizer.eos_token_id
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 300)


def test_uncommitted_missing_or_corrupt_checkpoints_are_refused_with_one_line(make_coordinator, tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    assert "no committed checkpoint" in one_error_line(capsys, export_cli(url, tmp_path / "a"))
    coordinator_checkpoint(make_coordinator, url, push=False)
    store = CheckpointStore(url)
    # A step torn by a crash: data, no commit marker.
    store.fs.makedirs(f"{store.root}/step-0000000004", exist_ok=True)
    store.fs.pipe_file(f"{store.root}/step-0000000004/state.pt", b"half a checkpoint")
    assert "checkpoint 4 " in (line := one_error_line(capsys, export_cli(url, tmp_path / "a", "--step", 4))) and "not committed" in line
    assert export_cli(url, tmp_path / "a") == 0 and "checkpoint 0 " in capsys.readouterr().out  # the newest committed one
    with open(f"{store.root}/step-0000000000/state.pt", "r+b") as f:  # bit rot
        f.seek(100)
        f.write(b"\x00\xff" * 8)
    line = one_error_line(capsys, export_cli(url, tmp_path / "b"))
    assert "corrupt" in line and not (tmp_path / "b").exists()
    # The console script says the same, as one line, exit status 2.
    out = subprocess.run([sys.executable, "-m", "diloco.cli.export", url, str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "corrupt" in out.stderr, out.stderr


def test_a_non_empty_folder_needs_force_and_an_old_checkpoint_needs_its_config(make_coordinator, tmp_path, capsys):
    url = str(tmp_path / "ckpt")
    cfg, _ = coordinator_checkpoint(make_coordinator, url, push=False)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("someone's")
    assert "--force" in one_error_line(capsys, export_cli(url, out))
    assert (out / "keep.txt").exists()
    assert export_cli(url, out, "--force") == 0 and not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temporary folder left behind
    # A checkpoint written before checkpoints recorded their config: --config, checked against the digest.
    meta_path = tmp_path / "ckpt" / "step-0000000000" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["config_toml"]
    meta_path.write_text(json.dumps(meta))
    assert "--config" in one_error_line(capsys, export_cli(url, tmp_path / "x"))
    (tmp_path / "other.toml").write_text(tiny_config("model.d_ff=32").to_toml())
    assert "is not the config" in one_error_line(capsys, export_cli(url, tmp_path / "x", "--config", tmp_path / "other.toml"))
    (tmp_path / "run.toml").write_text(cfg.to_toml())
    assert export_cli(url, tmp_path / "x", "--config", tmp_path / "run.toml") == 0


def test_export_from_s3(s3, make_coordinator, tmp_path):
    cfg, published = coordinator_checkpoint(make_coordinator, f"{s3}/run", push=False)
    assert export_cli(f"{s3}/run", tmp_path / "hf") == 0
    model_cfg, state = from_hf_folder(tmp_path / "hf")
    assert model_cfg == cfg.model and all(torch.equal(state[n], t) for n, t in published.items())
    # diloco-eval reads exported folders wherever they were uploaded.
    fs = fsspec.filesystem("s3")
    for f in (tmp_path / "hf").iterdir():
        fs.put_file(str(f), f"{s3}/hf/{f.name}")
    model_cfg, state = from_hf_folder(f"{s3}/hf")
    assert model_cfg == cfg.model and all(torch.equal(state[n], t) for n, t in published.items())


def test_the_demos_model_exports_where_the_docs_say(tmp_path, monkeypatch, capsys):
    """A newcomer's path: `diloco-sim --workdir runs/demo`, then diloco-export's --help example as written (the one
    docs/export-and-eval.md gives too): the simulation checkpoints its coordinator there by default, the last round
    included, and the folder loads with the final global parameters."""
    from diloco.cli.export import __doc__ as export_help
    from islands.sim.cli import main as sim_main

    example = next(line for line in export_help.splitlines() if "diloco-sim --workdir runs/demo" in line)
    command = example.split("#")[0].split()
    assert command[0] == "diloco-export" and " ".join(command) in open("docs/export-and-eval.md").read()
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config("rounds.rounds=2")
    (tmp_path / "tiny.toml").write_text(cfg.to_toml())
    stale = tmp_path / "runs/demo/ckpt/coordinator/step-0000000099"  # an earlier, longer run's in the same workdir
    stale.mkdir(parents=True)
    sim_main(["--workdir", "runs/demo", "--islands", "2", "--config", "tiny.toml", "--timeout", "240"])
    printed = capsys.readouterr().out
    assert "the model, as a Hugging Face folder: diloco-export runs/demo/ckpt/coordinator OUT_DIR" in printed

    assert export_cli(*command[1:]) == 0
    assert capsys.readouterr().out.startswith("checkpoint 2 (")  # the last round's, not checkpoint.every_rounds' (5)
    assert not stale.exists()
    model_cfg, state = from_hf_folder(tmp_path / command[2])
    assert model_cfg == cfg.model
    assert compare_with_transformers(tmp_path / command[2], cfg, state) < 1e-5
