"""`diloco-eval` and diloco/models/evaluation.py: held-out loss, HellaSwag scored as lm-evaluation-harness scores it,
the command on coordinator checkpoints (text and token runs) and exported folders, and one-line errors."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import one_island_config, tiny_config
from coordinator import durable
from diloco.checkpoint import CheckpointStore
from diloco.config import ConfigError
from diloco.data.sources import eval_batches
from diloco.cli.eval import main
from diloco.models.evaluation import (ByteTokenizer, EvalError, Example, choice_loglikelihoods, corpus_tokenizer, encode_pair,
                               heldout_loss, load_hellaswag, loglikelihoods, make_task_evaluator, multiple_choice)
from diloco.inner import evaluate
from diloco.models.llama import Transformer
from diloco.data.prepare import PrepareConfig, prepare

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the man sits on a roof and pulls up shingles while a dog runs across the yard near a river under "
         "the morning sun then he climbs down to wash the car").split()

# HellaSwag's two halves (ActivityNet, and WikiHow with its bracket artifacts), and what lm-eval makes of them.
DOCS = [
    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he", "endings": ["is using wrap to wrap a pair of skis.",
     "is ripping level tiles off.", "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "label": 3, "split": "val", "split_type": "indomain", "source_id": "activitynet~v_-JhWjGDPHMY"},
    {"activity_label": "Home and Garden", "ctx_a": "[header] How to clean a grill [title] Heat the grill.", "ctx_b": "",
     "endings": ["[step] Scrub the grates  with a brush.", "[substeps] Turn it off [title] Wait.", "  Leave it.  ",
                 "[step] Hose it down."], "label": "2"},
    {"activity_label": "Sports", "ctx_a": "The crowd cheers.", "ctx_b": "THE PLAYER runs",
     "endings": ["to the river.", "up the roof.", "across the yard.", "down the car."], "label": 2},
    {"ctx": " Only a context  here ", "endings": ["Run   fast.", "b"], "label": 1},
]
EXPECTED = [
    Example("Roof shingle removal: A man is sitting on a roof. He", tuple(DOCS[0]["endings"]), 3),
    Example("Home and Garden: How to clean a grill. Heat the grill.",
            (" Scrub the grates with a brush.", " Turn it off. Wait.", "Leave it.", " Hose it down."), 2),
    Example("Sports: The crowd cheers. The player runs", tuple(DOCS[2]["endings"]), 2),
    Example("Only a context here", ("Run  fast.", "b"), 1),  # one pass of "  " -> " ", as lm-eval's
]


def write_jsonl(path: Path, docs: list, blank_after: int = 1) -> str:
    lines = [d if isinstance(d, str) else json.dumps(d) for d in docs]
    lines.insert(blank_after, "")  # blank lines are skipped, and still counted in line numbers
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_text(path: Path, n_words: int = 1500, seed: int = 0) -> str:
    rng = random.Random(seed)
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(n_words)) + "\n")
    return str(path)


@pytest.mark.unit
def test_load_hellaswag_applies_lm_evals_preprocessing(tmp_path):
    assert load_hellaswag(write_jsonl(tmp_path / "h.jsonl", DOCS)) == EXPECTED
    assert load_hellaswag(write_jsonl(tmp_path / "h.jsonl", DOCS), limit=2) == EXPECTED[:2]


@pytest.mark.unit
@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('["a list"]', "not a JSON object"),
    ({"ctx": "c", "label": 0}, "'endings' must be a list"),
    ({"ctx": "c", "endings": ["a", 3], "label": 0}, "'endings' must be a list"),
    ({"ctx": "c", "endings": ["a", "b"]}, "'label' must be the index"),
    ({"ctx": "c", "endings": ["a", "b"], "label": "x"}, "'label' must be the index"),
    ({"ctx": "c", "endings": ["a", "b"], "label": 2}, "'label' 2 is not an index"),
    ({"endings": ["a", "b"], "label": 0}, "no context"),
    ({"ctx_a": 5, "ctx_b": "", "endings": ["a", "b"], "label": 0}, "'ctx_a' is int"),
])
def test_a_malformed_line_is_named_with_its_number(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [DOCS[0], line])  # line 1, a blank line 2, line 3
    with pytest.raises(EvalError, match=f"line 3: .*{message}"):
        load_hellaswag(path)


class Bigram(nn.Module):
    """A hand-built language model: the logits of the next byte are the row of the current one."""

    def __init__(self, table: torch.Tensor, max_seq_len: int = 64):
        super().__init__()
        self.table = nn.Parameter(table)
        self.cfg = SimpleNamespace(max_seq_len=max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]


@pytest.mark.unit
def test_a_choice_scores_the_log_probs_of_space_and_ending_after_the_query():
    table = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 3
    logp = torch.log_softmax(table.double(), -1)
    examples = EXPECTED + [Example("Ünïcode query", ("çà", "plain"), 0)]
    got = choice_loglikelihoods(Bigram(table), ByteTokenizer(), examples, batch=3)
    for ex, scores in zip(examples, got):
        for choice, score in zip(ex.choices, scores):
            data, start = (ex.query + " " + choice).encode(), len(ex.query.encode())
            want = sum(logp[data[i - 1], data[i]].item() for i in range(start, len(data)))
            assert score == pytest.approx(want, abs=1e-4)


@pytest.mark.unit
def test_acc_picks_the_highest_sum_and_acc_norm_the_highest_per_character():
    # Every byte costs ln 256 under a uniform model: the raw sum prefers the shortest ending, the sum per
    # character the longest (-(n+1)/n grows with n), so the two disagree and each example's outcome is known.
    endings = ("a short one", "the very longest ending of them all", "mid length", "tiny")
    examples = [
        Example("q", endings, 1),  # the longest: acc 0, acc_norm 1
        Example("q", endings, 3),  # the shortest: acc 1, acc_norm 0
        # Per character, not per byte: "éééé" is 4 characters and 8 bytes (9 scored tokens with the space):
        # -9/4 loses to "abcdef"'s -7/6, where per byte -9/8 would win. The raw sum picks "ab".
        Example("q", ("éééé", "abcdef", "ab", "abc"), 1),
        # "one" and "two" tie on the raw sum: the first wins (np.argmax); per character "three" does.
        Example("q", ("one", "two", "three", "four"), 3),
    ]
    uniform = Bigram(torch.zeros(256, 256))
    assert multiple_choice(uniform, ByteTokenizer(), examples, batch=5) == {"acc": 0.25, "acc_norm": 0.5, "n": 4}
    assert multiple_choice(uniform, ByteTokenizer(), examples[2:3]) == {"acc": 0.0, "acc_norm": 1.0, "n": 1}


@pytest.mark.unit
def test_encode_pair_moves_trailing_spaces_to_the_continuation_and_scores_an_empty_context_after_the_prefix():
    tok = ByteTokenizer()
    assert encode_pair(tok, "ab ", "c") == ([97, 98], [32, 99])
    assert encode_pair(tok, "", " c") == ([10], [32, 99])


def tiny_model(seed: int = 0, *overrides: str):
    cfg = tiny_config("model.vocab_size=256", "model.max_seq_len=16", "data.seq_len=16", *overrides)
    torch.manual_seed(seed)
    return cfg, Transformer(cfg.model)


@pytest.mark.unit
def test_long_contexts_lose_their_oldest_tokens_and_batching_changes_nothing():
    cfg, model = tiny_model()
    ctx, cont = list(range(40)), [50, 51, 52]
    requests = [(ctx, cont), (ctx[-5:], cont), ([7], [8]), (ctx[-20:], list(range(60, 80)))]
    got = loglikelihoods(model, requests, batch=3)
    assert got == pytest.approx(loglikelihoods(model, requests, batch=1), abs=1e-5)
    for (c, k), score in zip(requests, got):
        seq = (c + k)[-(cfg.model.max_seq_len + 1):]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).double(), -1)[0]
        n = min(len(k), len(seq) - 1)  # a continuation longer than the window: its last tokens that fit
        want = sum(logp[len(seq) - 1 - n + j, seq[len(seq) - n + j]].item() for j in range(n))
        assert score == pytest.approx(want, abs=1e-4)
    assert got[0] != pytest.approx(got[1], abs=1e-3)  # the context is seen


@pytest.mark.unit
def test_heldout_loss_is_the_mean_cross_entropy_and_perplexity_its_exp():
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    batches = eval_batches(cfg.data, 3, 4, cfg.model.vocab_size)
    loss, perplexity, tokens = heldout_loss(model, batches)
    assert loss == pytest.approx(evaluate(model, batches), rel=1e-6)
    assert perplexity == pytest.approx(math.exp(loss), rel=1e-12) and tokens == 3 * 4 * cfg.data.seq_len


# --- the command ------------------------------------------------------------------------


def coordinator_checkpoint(make_coordinator, tmp_path, *overrides: str, config_toml: bool = True):
    """(cfg, url, published params) of a coordinator checkpoint written by durable.save at round 0.
    config_toml=False writes one as a coordinator did before checkpoints recorded their config."""
    url = str(tmp_path / "ckpt")
    cfg = tiny_config(f"checkpoint.url={url!r}", *overrides)
    coordinator = make_coordinator(cfg)
    store = CheckpointStore(url)
    if config_toml:
        durable.save(coordinator.state, store)
    else:
        with coordinator.state.reading_all():
            tensors, meta = durable.snapshot(coordinator.state)
        meta.pop("config_toml", None)
        store.save(meta["step"], tensors, meta)
    return cfg, url, {n: t.clone() for n, t in coordinator.state.params.items()}


def run_cli(*args, capsys) -> tuple[dict, str]:
    """(the --json report, the table printed) of a run of the command that succeeds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        assert main([*map(str, args), "--json", str(out), "--device", "cpu"]) == 0
        return json.loads(out.read_text()), capsys.readouterr().out


def library_figures(cfg, params, tokenizer, hellaswag: str, data=None) -> dict:
    model = Transformer(cfg.model)
    model.load_state_dict(params)
    loss, ppl, tokens = heldout_loss(model, eval_batches(data or cfg.data, cfg.eval.batches or 8, cfg.eval.batch_size,
                                                         cfg.model.vocab_size))
    return {"loss": loss, "perplexity": ppl, "tokens": tokens,
            **multiple_choice(model, tokenizer, load_hellaswag(hellaswag), cfg.eval.batch_size)}


def check(report: dict, want: dict) -> None:
    held, mc = report["heldout"], report["hellaswag"]
    assert held["loss"] == pytest.approx(want["loss"], rel=1e-6) and held["tokens"] == want["tokens"]
    assert held["perplexity"] == pytest.approx(math.exp(held["loss"]))
    assert (mc["acc"], mc["acc_norm"], mc["n"]) == (want["acc"], want["acc_norm"], want["n"])


@pytest.fixture
def text_run(make_coordinator, tmp_path):
    text = write_text(tmp_path / "text.txt")
    hellaswag = write_jsonl(tmp_path / "h.jsonl", DOCS)
    cfg, url, params = coordinator_checkpoint(make_coordinator, tmp_path, "data.source=text", f"data.path={text!r}",
                                              "model.vocab_size=256")
    return SimpleNamespace(cfg=cfg, url=url, params=params, text=text, hellaswag=hellaswag, tmp=tmp_path)


@pytest.mark.integration
def test_the_command_on_a_text_run_checkpoint_and_on_its_export(text_run, capsys):
    r = text_run
    want = library_figures(r.cfg, r.params, ByteTokenizer(), r.hellaswag)
    report, out = run_cli(r.url, "--hellaswag", r.hellaswag, capsys=capsys)  # the run's own held-out text
    check(report, want)
    assert (report["kind"], report["step"], report["hellaswag"]["tokenizer"]) == ("checkpoint", 0, "bytes")
    assert "perplexity" in out and "acc_norm" in out and "step 0 (round 0)" in out
    check(run_cli(f"{r.url}/step-0000000000", "--text", r.text, "--hellaswag", r.hellaswag, capsys=capsys)[0], want)

    from diloco.models.export import export

    folder = r.tmp / "exported"
    export(r.url, folder)
    report, out = run_cli(folder, "--text", r.text, "--hellaswag", r.hellaswag, capsys=capsys)
    check(report, want)
    assert report["kind"] == "folder"


@pytest.mark.integration
def test_an_export_is_evaluated_on_its_runs_held_out_set_and_settings_as_its_checkpoint(make_coordinator, tmp_path, capsys):
    """The export carries the run's config: `diloco-eval FOLDER` with no flags measures what `diloco-eval CHECKPOINT`
    does (the run's held-out data, eval.batches, eval.batch_size and data.seq_len), not 8 batches of the model's
    max_seq_len on no data at all."""
    from diloco.models.export import export

    text = write_text(tmp_path / "text.txt")
    cfg, url, _ = coordinator_checkpoint(make_coordinator, tmp_path, "data.source=text", f"data.path={text!r}",
                                         "model.vocab_size=256", "eval.batches=3", "eval.batch_size=2",
                                         "model.max_seq_len=64")  # the run's seq_len is 32, the model's window 64
    folder = tmp_path / "exported"
    export(url, folder)
    from_checkpoint = run_cli(url, capsys=capsys)[0]["heldout"]
    from_folder = run_cli(folder, capsys=capsys)[0]["heldout"]
    assert (from_folder["batches"], from_folder["batch_size"], from_folder["seq_len"]) == (3, 2, 32)
    assert from_folder == from_checkpoint


@pytest.mark.integration
def test_a_checkpoint_without_its_config_needs_the_runs_and_refuses_another(make_coordinator, tmp_path, capsys):
    from diloco.cli.data import main as datacli

    corpus = tmp_path / "corpus.txt"
    rng = random.Random(1)
    corpus.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randrange(30, 90))) for _ in range(150)))
    tokens = str(tmp_path / "tokens")
    assert datacli(["prepare", str(corpus), "-o", tokens, "--train-tokenizer", "--vocab-size", "300",
                    "--eval-fraction", "0.2", "--shard-tokens", "4096", "--workers", "1"]) == 0
    hellaswag = write_jsonl(tmp_path / "h.jsonl", DOCS)
    overrides = ("data.source=tokens", f"data.url={tokens!r}", "model.vocab_size=0",
                 f"data.cache_dir={str(tmp_path / 'cache')!r}")
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(tiny_config(f"checkpoint.url={str(tmp_path / 'ckpt')!r}", *overrides).to_toml())  # vocab 0
    cfg, url, params = coordinator_checkpoint(make_coordinator, tmp_path, *overrides, config_toml=False)
    want = library_figures(cfg, params, corpus_tokenizer(tokens), hellaswag)
    assert cfg.model.vocab_size == 300

    with pytest.raises(SystemExit) as e:
        main([url, "--hellaswag", hellaswag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "the default config gives" in err and "--config" in err
    # The run's config (vocabulary 0: the corpus's, as the coordinator resolved it), the corpus's tokenizer.
    report, _ = run_cli(url, "--config", run_toml, "--hellaswag", hellaswag, capsys=capsys)
    check(report, want)
    assert report["hellaswag"]["tokenizer"].endswith("tokenizer.json")
    check(run_cli(url, "--config", run_toml, "--tokens", tokens, "--hellaswag", hellaswag, capsys=capsys)[0], want)


@pytest.mark.integration
def test_bad_input_exits_2_with_one_line(text_run, capsys):
    r, tmp = text_run, text_run.tmp
    (tmp / "empty").mkdir()
    torn = tmp / "torn"
    shutil.copytree(r.url, torn)
    (torn / "step-0000000000" / "COMMITTED").unlink()
    (tmp / "hf").mkdir()
    (tmp / "hf" / "config.json").write_text("{}")
    bad = write_jsonl(tmp / "bad.jsonl", [DOCS[0], DOCS[1], {"ctx": "c", "endings": ["a"], "label": 0}])
    cases = [
        ([tmp / "absent"], "no checkpoint at"),
        ([tmp / "empty"], "no step-NNNNNNNNNN folders"),
        ([torn], "1 step folder(s), none committed"),
        ([torn / "step-0000000000"], "checkpoint 0 under"),
        ([r.url, "--hellaswag", tmp / "absent.jsonl"], "HellaSwag file not found"),
        ([r.url, "--hellaswag", bad], "bad.jsonl line 4: 'endings'"),
        ([r.url, "--text", tmp / "absent.txt"], "text file not found"),
        ([r.url, "--seq-len", "64"], "exceeds the model's max_seq_len"),
        ([r.url, "--set", "model.d_model=64"], "config digest"),
        ([r.url, "--batches", "-1"], "--batches must be >= 0"),
        ([tmp / "hf"], "cannot read the exported model"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as e:
            main([*map(str, args), "--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2, args
        assert err.startswith("diloco-eval: error: ") and err.count("\n") == 1 and message in err, (args, err)
    # As a command: one line on stderr, status 2.
    done = subprocess.run([sys.executable, "-m", "diloco.cli.eval", str(tmp / "absent")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no checkpoint at" in done.stderr


@pytest.mark.unit
def test_the_coordinators_task_evaluator(tmp_path):
    text, hellaswag = write_text(tmp_path / "t.txt"), write_jsonl(tmp_path / "h.jsonl", DOCS)
    run = ("data.source=text", f"data.path={text!r}", "model.vocab_size=256")
    assert make_task_evaluator(tiny_config(*run)) is None  # off by default
    cfg = tiny_config(*run, f"eval.hellaswag={hellaswag!r}", "eval.tasks_every_rounds=2", "eval.hellaswag_examples=3")
    tasks = make_task_evaluator(cfg)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    want = multiple_choice(model, ByteTokenizer(), EXPECTED[:3], cfg.eval.batch_size)
    assert tasks(model.state_dict()) == {"hellaswag_acc": want["acc"], "hellaswag_acc_norm": want["acc_norm"],
                                         "hellaswag_n": 3.0}
    with pytest.raises(ConfigError, match="synthetic"):  # no text to tokenize
        make_task_evaluator(tiny_config(f"eval.hellaswag={hellaswag!r}", "eval.tasks_every_rounds=2"))
    with pytest.raises(ConfigError, match="not found"):
        make_task_evaluator(tiny_config(*run, f"eval.hellaswag={str(tmp_path / 'no.jsonl')!r}", "eval.tasks_every_rounds=1"))


@pytest.mark.integration
def test_the_coordinator_scores_the_tasks_every_n_rounds_and_logs_them(make_coordinator, channel_to, tmp_path):
    from diloco.wire.codec import Fp32Codec
    from diloco.v1 import diloco_pb2 as pb
    from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

    from conftest import claim, trained_from, wait_for_round

    text, hellaswag = write_text(tmp_path / "t.txt"), write_jsonl(tmp_path / "h.jsonl", DOCS)
    cfg = one_island_config("data.source=text", f"data.path={text!r}", "model.vocab_size=256", "rounds.rounds=4",
                      f"eval.hellaswag={hellaswag!r}", "eval.tasks_every_rounds=2", "eval.hellaswag_examples=3")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).island_id
    zeros = {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}
    for round_ in range(4):
        header = pb.PushHeader(island_id=island, round=round_, codec="fp32", **claim(cfg),  # an honest claim
                               global_checksum=trained_from(coordinator))
        stub.PushPseudoGradient(push_messages(header, tensor_chunks(zeros, Fp32Codec(), 4096)), timeout=30)
        wait_for_round(coordinator, round_, timeout_s=120)
    scored = {s.round: dict(s.task_scores) for s in coordinator.state.summaries if s.task_scores}
    assert sorted(scored) == [1, 3]  # after every 2 rounds (the last is also the run's end)
    model = Transformer(cfg.model)
    model.load_state_dict(coordinator.state.params, strict=False)
    want = multiple_choice(model, ByteTokenizer(), EXPECTED[:3], cfg.eval.batch_size)
    assert scored[3] == {"hellaswag_acc": want["acc"], "hellaswag_acc_norm": want["acc_norm"], "hellaswag_n": 3.0}
    from diloco.jsonlog import message_dict  # the run log's JSON line carries them as a plain mapping

    last = coordinator.state.summaries[-1]
    assert message_dict(last)["task_scores"] == scored[3]


# --- text on a model with a tokenizer -------------------------------------------------------


def train(model: nn.Module, ids: list[int], seq_len: int, steps: int = 200) -> None:
    """A few hundred AdamW steps on random windows of ids: enough for a tiny model to learn a repetitive text."""
    data, g = torch.tensor(ids), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (16,), generator=g).tolist()
        seqs = torch.stack([data[s:s + seq_len + 1] for s in starts])
        loss = F.cross_entropy(model(seqs[:, :-1]).flatten(0, 1), seqs[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture
def bpe_folder(make_coordinator, tmp_path):
    """A diloco-export folder (with tokenizer.json) of a token run on a BPE corpus of a text, its weights
    trained on the BPE tokens of the text's head, and the text."""
    from diloco.models.export import export
    from diloco.models.hf import from_hf_folder

    text = tmp_path / "river.txt"
    sentences = [f"the river {i % 13} runs past the stone island {i % 7}." for i in range(600)]
    # Paragraphs: prepare cuts documents at blank lines, and holds some of them out.
    text.write_text("\n\n".join(" ".join(sentences[i:i + 5]) for i in range(0, 600, 5)) + "\n")
    corpus = str(tmp_path / "tokens")
    prepare(PrepareConfig([str(text)], corpus, vocab_size=300, eval_fraction=0.1, shard_tokens=4096, workers=1))
    url = str(tmp_path / "ckpt")
    cfg = tiny_config(f"checkpoint.url={url!r}", "data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0",
                      f"data.cache_dir={str(tmp_path / 'cache')!r}", "data.shuffle_block=8")
    coordinator = make_coordinator(cfg)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    head = text.read_text()[:int(len(text.read_text()) * 0.9)]  # not the held-out tail
    train(model, corpus_tokenizer(corpus).encode(head), cfg.model.max_seq_len)
    trained = model.state_dict()
    with torch.no_grad():  # the checkpoint holds the trained model, as if the run had trained it
        for params in (coordinator.state.params, coordinator.state.outer_params):
            for n, t in params.items():
                t.copy_(trained[n])
    durable.save(coordinator.state, CheckpointStore(url))
    folder = tmp_path / "hf"
    export(url, folder)
    model_cfg, state = from_hf_folder(folder)
    assert (folder / "tokenizer.json").is_file() and model_cfg.vocab_size > 256  # BPE stops merging short of 300
    assert all(torch.equal(state[n], t) for n, t in trained.items())
    return SimpleNamespace(folder=folder, text=str(text), model_cfg=model_cfg, params=state, tmp=tmp_path)


def tokenized_heldout_loss(b, seq_len: int, n_batches: int, batch_size: int) -> tuple[float, int]:
    """The loss of the folder's model on the tail a run on the text holds out (10%), encoded with its
    tokenizer.json (the tokenizers library, no special tokens), in eval_batches' evenly spaced windows."""
    from tokenizers import Tokenizer as HF

    data = Path(b.text).read_bytes()
    tail = data[int(len(data) * 0.9):].decode()
    ids = torch.tensor(HF.from_file(str(b.folder / "tokenizer.json")).encode(tail, add_special_tokens=False).ids)
    starts = np.linspace(0, len(ids) - seq_len - 1, num=n_batches * batch_size, dtype=np.int64).tolist()
    seqs = torch.stack([ids[s:s + seq_len + 1] for s in starts])
    model = Transformer(b.model_cfg)
    model.load_state_dict(b.params)
    loss, _, tokens = heldout_loss(model, [(x[:, :-1], x[:, 1:]) for x in seqs.split(batch_size)])
    return loss, tokens


@pytest.mark.integration
def test_text_on_an_exported_bpe_model_is_read_with_its_tokenizer(bpe_folder, capsys):
    b = bpe_folder
    loss, tokens = tokenized_heldout_loss(b, b.model_cfg.max_seq_len, 2, 4)
    hellaswag = write_jsonl(b.tmp / "h.jsonl", DOCS)
    report, out = run_cli(b.folder, "--text", b.text, "--batches", 2, "--batch-size", 4, "--hellaswag", hellaswag,
                          capsys=capsys)
    held = report["heldout"]
    assert held["loss"] == pytest.approx(loss, rel=1e-6) and held["tokens"] == tokens == 2 * 4 * b.model_cfg.max_seq_len
    # Trained: far below the ~300 of a uniform guess (read as bytes, this text scored a perplexity in the thousands).
    assert held["perplexity"] == pytest.approx(math.exp(loss)) and held["perplexity"] < 10
    assert "tokenized by" in held["data"] and "tokenizer.json" in out
    assert report["hellaswag"]["tokenizer"].endswith("tokenizer.json")  # one tokenizer for all the text
    # A folder without its tokenizer.json reads the text with the one given.
    bare = b.tmp / "bare"
    shutil.copytree(b.folder, bare)
    (bare / "tokenizer.json").unlink()
    given, _ = run_cli(bare, "--text", b.text, "--tokenizer", b.folder / "tokenizer.json", "--batches", 2,
                       "--batch-size", 4, capsys=capsys)
    assert given["heldout"]["loss"] == pytest.approx(loss, rel=1e-6)


@pytest.mark.integration
def test_text_on_a_model_without_a_tokenizer_is_refused_unless_it_is_byte_level(bpe_folder, text_run, capsys):
    bare = bpe_folder.tmp / "bare"
    shutil.copytree(bpe_folder.folder, bare)
    # A Llama folder from elsewhere: no tokenizer, and no run config (diloco_run.toml) to find its corpus's by.
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "diloco_run.toml"):
        (bare / name).unlink()
    for flags in (["--text", bpe_folder.text], ["--hellaswag", text_run.hellaswag]):
        with pytest.raises(SystemExit) as e:
            main([str(bare), *flags, "--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("diloco-eval: error: ") and err.count("\n") == 1, err
        assert "no tokenizer.json" in err and "--tokenizer FILE" in err, err
        assert f"vocabulary of {bpe_folder.model_cfg.vocab_size} " in err, err
    # A model of 256 tokens without one is byte-level: the text's bytes, as a byte-level run reads them.
    from diloco.models.export import export

    export(text_run.url, text_run.tmp / "bytes-hf")
    report, _ = run_cli(text_run.tmp / "bytes-hf", "--text", text_run.text, capsys=capsys)
    assert report["heldout"]["loss"] == pytest.approx(library_figures(text_run.cfg, text_run.params, ByteTokenizer(),
                                                                      text_run.hellaswag)["loss"], rel=1e-6)
    assert "tokenized by" not in report["heldout"]["data"]
