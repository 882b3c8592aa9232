"""`diloco-data prepare` and `inspect`: inputs, tokenizers, determinism, resume after a kill, S3 in and out."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pytest
import zstandard

from diloco.data.bpe import train_bpe
from diloco.data.corpus import documents, is_eval
from diloco.cli.data import main
from diloco.data.prepare import KILL_AT_SHARD
from diloco.data.shards import open_store

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
WORDS = "the a river stone light cold warm island token round push pull shard cache read write".split()


def text_doc(rng) -> str:
    lines = [" ".join(rng.choice(WORDS, int(rng.integers(3, 12)))) + "\n" for _ in range(int(rng.integers(1, 4)))]
    return "".join(lines)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Plain text (blank-line documents), JSON lines, and both compressed: about 1,600 documents."""
    rng = np.random.default_rng(0)
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("\n".join(text_doc(rng) for _ in range(400)))
    (d / "b.jsonl").write_text("".join(json.dumps({"text": text_doc(rng), "id": i}) + "\n" for i in range(400)))
    (d / "c.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps({"text": text_doc(rng)}) + "\n"
                                                         for _ in range(400)).encode()))
    (d / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(text_doc(rng) for _ in range(400)).encode()))
    return d


def run(*args: str) -> None:
    assert main(["prepare", *args]) == 0


def files_of(url: str) -> dict[str, bytes]:
    """Every file of a finished dataset but the prepare state, by relative name."""
    fs, root = fsspec.core.url_to_fs(url)
    return {p[len(root.rstrip("/")) + 1:]: fs.cat_file(p) for p in fs.find(root) if not p.endswith("prepare-state.json")}


def expected_stream(inputs: list[str], tokenizer_json: str, eos_id: int, eval_fraction: float) -> dict[str, np.ndarray]:
    """What the splits must hold: each document tokenized alone, eos after it, in input order."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    out = {"train": [], "eval": []}
    for url in inputs:
        for text in documents(url):
            out["eval" if is_eval(text, eval_fraction) else "train"] += tok.encode(text, add_special_tokens=False).ids + [eos_id]
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.integration
def test_prepare_reads_every_input_kind_and_the_store_reads_it_back(corpus, tmp_path):
    out = tmp_path / "out"
    run(str(corpus / "*"), "-o", str(out), "--train-tokenizer", "--vocab-size", "300", "--shard-tokens", "5000",
        "--eval-fraction", "0.05", "--workers", "2")
    manifest = json.loads((out / "manifest.json").read_text())
    tokenizer = (out / "tokenizer.json").read_text()
    inputs = sorted(str(p) for p in corpus.iterdir())
    expected = expected_stream(inputs, tokenizer, manifest["eos_id"], 0.05)
    assert manifest["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    assert 0 < len(expected["eval"]) < len(expected["train"]) / 5
    for split in ("train", "eval"):
        assert manifest["splits"][split]["tokens"] == len(expected[split])
        with open_store(str(out), split, cache_dir=tmp_path / "cache") as store:
            assert np.array_equal(store.read(0, store.total), expected[split])
    assert all(s["tokens"] == 5000 for s in manifest["splits"]["train"]["shards"][:-1])
    assert main(["inspect", str(out)]) == 0


@pytest.mark.integration
def test_same_output_whatever_the_workers_and_a_given_tokenizer_is_used_as_is(corpus, tmp_path):
    common = [str(corpus / "a.txt"), str(corpus / "b.jsonl"), "--shard-tokens", "3000"]
    run(*common, "-o", str(tmp_path / "w1"), "--train-tokenizer", "--vocab-size", "320", "--workers", "1")
    run(*common, "-o", str(tmp_path / "w2"), "--train-tokenizer", "--vocab-size", "320", "--workers", "2")
    one, two = files_of(str(tmp_path / "w1")), files_of(str(tmp_path / "w2"))
    assert one == two and len(one) > 4
    given = tmp_path / "w1" / "tokenizer.json"
    run(*common, "-o", str(tmp_path / "given"), "--tokenizer", str(given), "--workers", "2")
    assert files_of(str(tmp_path / "given")) == one  # the same tokenizer file, the same tokens


@pytest.mark.unit
def test_trained_tokenizer_is_deterministic(corpus):
    texts = list(documents(str(corpus / "a.txt")))
    first = train_bpe(iter(texts), 400, "<|endoftext|>")
    assert train_bpe(iter(texts), 400, "<|endoftext|>") == first
    assert json.loads(first)["added_tokens"][0]["content"] == "<|endoftext|>"


@pytest.mark.integration
def test_prepare_from_and_to_s3_equals_local(corpus, tmp_path, s3):
    fs = fsspec.filesystem("s3")
    for name in ("b.jsonl", "d.txt.zst"):
        fs.put_file(str(corpus / name), f"diloco-test/in/{name}")
    flags = ["--train-tokenizer", "--vocab-size", "300", "--shard-tokens", "4000", "--workers", "2"]
    run(f"{s3}/in/*", "-o", f"{s3}/out", *flags)
    run(str(corpus / "b.jsonl"), str(corpus / "d.txt.zst"), "-o", str(tmp_path / "local"), *flags)
    assert files_of(f"{s3}/out") == files_of(str(tmp_path / "local"))
    with open_store(f"{s3}/out", cache_dir=tmp_path / "cache") as store:
        local = open_store(str(tmp_path / "local"), cache_dir=tmp_path / "cache2")
        assert np.array_equal(store.read(0, store.total), local.read(0, local.total))
        local.close()


def prepare_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "diloco.cli.data", "prepare", *args]


@pytest.mark.integration
def test_a_killed_prepare_resumes_to_the_same_bytes(corpus, tmp_path):
    args = [str(corpus / "a.txt"), str(corpus / "c.jsonl.gz"), "--train-tokenizer", "--vocab-size", "300",
            "--shard-tokens", "700", "--workers", "2"]
    run(*args, "-o", str(tmp_path / "whole"))
    out = tmp_path / "killed"
    # SIGKILL in the middle of writing the 25th training shard (half of it on disk under a temporary name),
    # in the second file's batch: the first one's shards are recorded in the state.
    killed = subprocess.run(prepare_cmd(*args, "-o", str(out)), cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, KILL_AT_SHARD: "25"}, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "manifest.json").exists() and not (out / "train" / "shard-00024.bin").exists()
    assert any(p.name.startswith("shard-00024.bin.tmp") for p in (out / "train").iterdir())
    state = json.loads((out / "prepare-state.json").read_text())
    assert not state["complete"] and 0 < len(state["splits"]["train"]["shards"]) < 24
    recorded = (out / "train" / "shard-00000.bin").stat().st_ino
    resumed = subprocess.run(prepare_cmd(*args, "-o", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert files_of(str(out)) == files_of(str(tmp_path / "whole"))
    assert (out / "train" / "shard-00000.bin").stat().st_ino == recorded  # continued, not started again
    assert not any(".tmp" in name or "pending" in name for name in files_of(str(out)))


def cli_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("diloco-data")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.integration
def test_bad_input_is_one_line_and_exit_2(corpus, tmp_path, capsys):
    run(str(corpus / "a.txt"), "-o", str(tmp_path / "out"), "--train-tokenizer", "--vocab-size", "300")
    assert "other inputs or flags" in cli_error(capsys, "prepare", str(corpus / "a.txt"), "-o", str(tmp_path / "out"),
                                                "--train-tokenizer", "--vocab-size", "301")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "not empty" in cli_error(capsys, "prepare", str(corpus / "a.txt"), "-o", str(tmp_path / "full"),
                                    "--train-tokenizer", "--vocab-size", "300")
    assert "does not exist" in cli_error(capsys, "prepare", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "o2"),
                                         "--train-tokenizer", "--vocab-size", "300")
    assert "--vocab-size" in cli_error(capsys, "prepare", str(corpus / "a.txt"), "-o", str(tmp_path / "o3"),
                                       "--train-tokenizer")
    assert "'body'" in cli_error(capsys, "prepare", str(corpus / "b.jsonl"), "-o", str(tmp_path / "o4"),
                                 "--train-tokenizer", "--vocab-size", "300", "--text-field", "body")
    assert "<nope>" in cli_error(capsys, "prepare", str(corpus / "a.txt"), "-o", str(tmp_path / "o5"),
                                 "--tokenizer", str(tmp_path / "out" / "tokenizer.json"), "--eos-token", "<nope>")


@pytest.mark.integration
def test_inspect_names_a_damaged_shard(corpus, tmp_path, capsys):
    run(str(corpus / "a.txt"), "-o", str(tmp_path / "out"), "--train-tokenizer", "--vocab-size", "300",
        "--shard-tokens", "2000")
    shard = tmp_path / "out" / "train" / "shard-00001.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 1
    assert f"BAD {tmp_path / 'out'}/train/shard-00001.bin: checksum mismatch" in capsys.readouterr().out


@pytest.mark.integration
def test_real_text(tmp_path):
    text = SHARED / "wikitext2-valid.txt"
    if not text.exists():
        pytest.skip(f"{text} is missing (the shared data folder beside the repository)")
    run(str(text), "-o", str(tmp_path / "wiki"), "--train-tokenizer", "--vocab-size", "2048", "--shard-tokens", "65536")
    with open_store(str(tmp_path / "wiki"), cache_dir=tmp_path / "cache") as store:
        tokens = store.read(0, store.total)
        assert store.total > 200_000 and tokens.max() < 2048 and (tokens == store.eos_id).sum() > 500
