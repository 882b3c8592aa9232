"""The convergence benchmark on a token corpus: islands read disjoint leased positions, DDP their union,
and every method trains (a tiny --quick run on a corpus this test prepares)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco.config import load_config
from diloco.data.sources import eval_batches, open_corpus
from diloco.inner import evaluate
from diloco.models.llama import Transformer
from diloco.data.prepare import PrepareConfig, prepare

from benchmarks.convergence_data import LeasedStream

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("the river north stone city ran over a quiet bridge where old ships came in winter and left "
         "with grain salt iron wool for markets of the south coast under grey skies").split()


def make_corpus(tmp_path: Path) -> Path:
    """A small English-like text (blank-line documents), tokenized with a BPE trained on it."""
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + " ." for _ in range(600)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(docs) + "\n")
    out = tmp_path / "tokens"
    prepare(PrepareConfig(inputs=[str(text)], output=str(out), vocab_size=320, eval_fraction=0.1, workers=1))
    return out


def test_islands_read_disjoint_leased_positions_and_ddp_reads_their_union(tmp_path):
    url = make_corpus(tmp_path)
    cfg = load_config(None, ["data.source='tokens'", f"data.url='{url}'", f"data.cache_dir='{tmp_path / 'cache'}'",
                             "data.seq_len=16", "model.vocab_size=0", "model.max_seq_len=16"])
    samples = open_corpus(cfg.data, seed=3).samples
    islands, b, steps = 3, 4, 5
    streams = [LeasedStream(samples, m, islands) for m in range(islands)]
    for step in range(steps):
        union = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in (s.next_batch(b) for s in streams)])
        # the M islands' batches at step k are positions k*M*b .. (k+1)*M*b, in island order
        assert torch.equal(union, samples.sequences(step * islands * b, islands * b))


def test_convergence_benchmark_trains_every_method_on_a_token_corpus(tmp_path):
    url = make_corpus(tmp_path)
    out = tmp_path / "convergence.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.convergence", "--quick", "--tokens", str(url), "--seeds", "0",
         "--methods", "ddp,diloco,single", "--codecs", "e3m0+zstd", "--workers", "1", "--quiet",
         "--set", f"data.cache_dir={tmp_path / 'cache'}", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    vocab = json.loads((url / "manifest.json").read_text())["vocab_size"]
    assert f"model.vocab_size={vocab}" in report["setup"]["overrides"]  # the manifest's vocabulary
    assert f"BPE (vocab {vocab}) Transformer" in run.stdout
    runs = {r["method"]: r for r in report["runs"]}
    assert set(runs) == {"ddp", "diloco", "single", "diloco:e3m0+zstd"}
    steps, batch, islands = (report["setup"][k] for k in ("steps", "batch", "islands"))
    # the untrained model's loss on the same held-out batches (what every method starts from)
    cfg = load_config(None, [*report["setup"]["overrides"], "seed=0"])
    torch.manual_seed(0)
    initial = evaluate(Transformer(cfg.model), eval_batches(cfg.data, report["setup"]["eval_batches"],
                                                            report["setup"]["eval_batch_size"], vocab))
    for method, r in runs.items():
        assert math.isfinite(r["final_eval"]) and r["final_eval"] < initial - 0.5, (method, r["final_eval"], initial)
        per_step = batch // islands if method == "single" else batch
        assert r["tokens"] == steps * per_step * cfg.data.seq_len
    assert runs["diloco:e3m0+zstd"]["bytes_up"] * 4 < runs["diloco"]["bytes_up"]  # the 4-bit wire really ran


def test_convergence_refuses_a_missing_token_corpus_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.convergence", "--quick",
                          "--tokens", str(tmp_path / "nothing")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-1000:]
    assert lines[0].startswith(f"convergence: error: --tokens {tmp_path / 'nothing'}: ") and "manifest.json" in lines[0]
