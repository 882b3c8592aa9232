"""Evaluating a model: held-out loss and perplexity, and multiple-choice accuracy on HellaSwag files.

Held-out loss is the token-weighted mean cross-entropy (nats/token) over fixed batches (the ones
diloco.data.sources.eval_batches builds, the coordinator's own), perplexity its exp.

Multiple choice follows lm-evaluation-harness's `hellaswag` task (lm_eval/tasks/hellaswag/utils.py
and hellaswag.yaml; the scoring in lm_eval/api/task.py and models/huggingface.py), so figures sit
next to published ones for the same model:

- A document's query is preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()) and
  its choices are preprocess(ending); preprocess strips, turns " [title]" into ". ", deletes every
  "[...]" (WikiHow's "[header]", "[step]", ...) and then turns double spaces into single ones.
  (str.capitalize also lowercases the rest of ctx_b: lm-eval does, so we do.)
- Each choice is scored by the sum of the log-probabilities of the tokens of " " + choice given
  the query: the text is encoded whole and the continuation's tokens are those past the query's
  own encoding (trailing spaces of the query move to the continuation), and when context plus
  continuation exceed the model's window the oldest tokens are dropped (the left).
- acc: the argmax of the raw sums; acc_norm: the argmax of each sum divided by len(choice), its
  length in characters (not bytes, not tokens), the first maximum winning ties (np.argmax).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import fsspec
import torch
import torch.nn as nn
import torch.nn.functional as F

from diloco.config import ConfigError, DataConfig, RunConfig
from diloco.data.sources import Batch
from diloco.inner import compute_precision
from diloco.params import load_parameters

log = logging.getLogger(__name__)

IGNORE = -100  # F.cross_entropy's ignore_index: context and padding positions score nothing


class EvalError(ValueError):
    """Evaluation input that cannot be used; the message (one line) names the file, the line and what is wrong."""


# --- held-out loss ---------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model: nn.Module, batches: Sequence[Batch], device: torch.device | str = "cpu") -> tuple[float, float, int]:
    """(mean cross-entropy in nats/token, perplexity, tokens) of model over batches.

    Token-weighted (a sum over every target, divided by their number): with batches of one shape,
    as eval_batches makes them, it equals the mean of the per-batch losses diloco.inner.evaluate gives.
    """
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for inputs, targets in batches:
            with compute_precision(device):
                logits = model(inputs.to(device))
            total += F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), reduction="sum").item()
            tokens += targets.numel()
    finally:
        model.train(was_training)
    if tokens == 0:
        raise EvalError("no held-out tokens to evaluate on")
    loss = total / tokens
    return loss, _exp(loss), tokens


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:  # an untrained model of a huge vocabulary can get there; say inf, not crash
        return math.inf


# --- tokenizers -------------------------------------------------------------------


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    prefix_id: int  # scored after when a context is empty (lm-eval uses the end-of-text token)

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Byte-level text runs (data.source = "text"): a token is a byte of the UTF-8 text, as diloco/data/sources.py
    reads a text file."""

    name = "bytes"
    vocab_size = 256
    prefix_id = 10  # "\n": what separates the documents of a text file

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json (a token corpus's, or an exported folder's)."""

    def __init__(self, tokenizer_json: str, name: str, eos_token: str = "<|endoftext|>"):
        from tokenizers import Tokenizer as Loaded

        try:
            self.tokenizer = Loaded.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own Exception subclass for a bad file
            raise EvalError(f"{name}: not a Hugging Face tokenizers file ({_one_line(e)})") from None
        self.name = name
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.tokenizer.token_to_id(eos_token)
        self.prefix_id = eos if eos is not None else 0

    @classmethod
    def from_url(cls, url: str, eos_token: str = "<|endoftext|>") -> HFTokenizer:
        try:
            with fsspec.open(url, "rt", encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise EvalError(f"tokenizer file not found: {url}") from None
        return cls(text, url, eos_token)

    def encode(self, text: str) -> list[int]:
        # No special tokens: lm-eval's HF models add none to the context of a causal LM either.
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def corpus_tokenizer(url: str) -> HFTokenizer:
    """The tokenizer a corpus made by `diloco-data prepare` was tokenized with (its manifest names it)."""
    from diloco.data.shards import DataError, read_manifest

    where = f"{url.rstrip('/')}/"
    try:
        manifest, _ = read_manifest(url)
        where += manifest.tokenizer_file
        with fsspec.open(where, "rb") as f:
            data = f.read()
    except (DataError, FileNotFoundError) as e:
        raise EvalError(f"no tokenizer for {url}: {_one_line(e)} (an MDS dataset names none)") from None
    # The tokens were made with the tokenizer the manifest names: another one would score other text.
    if hashlib.sha256(data).hexdigest() != manifest.tokenizer_sha256:
        raise EvalError(f"{where} does not match the sha256 its manifest records")
    return HFTokenizer(data.decode("utf-8"), where, manifest.eos_token)


def run_tokenizer(data: DataConfig) -> Tokenizer:
    """The tokenizer that turns text into what a run on `data` trained on."""
    if data.source == "tokens":
        return corpus_tokenizer(data.url)
    if data.source == "text":
        return ByteTokenizer()
    raise EvalError("a run on the synthetic language has no tokenizer for text: multiple choice needs a run on "
                    "text (data.source = 'text') or a token corpus, or a tokenizer given")


# --- HellaSwag files ------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    query: str
    choices: tuple[str, ...]
    gold: int


def preprocess(text: str) -> str:
    """lm-eval's hellaswag preprocess: brackets are artifacts of HellaSwag's WikiHow half."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _string(doc: dict, key: str, where: str) -> str:
    value = doc[key]
    if not isinstance(value, str):
        raise EvalError(f"{where}: field {key!r} is {type(value).__name__}, not a string")
    return value


def example_from(doc: object, where: str) -> Example:
    """One HellaSwag document (a parsed JSON line) as lm-eval's process_docs makes it."""
    if not isinstance(doc, dict):
        raise EvalError(f"{where}: not a JSON object")
    if "ctx_a" in doc:
        ctx = _string(doc, "ctx_a", where) + " " + (_string(doc, "ctx_b", where) if "ctx_b" in doc else "").capitalize()
    elif "ctx" in doc:  # files that only carry the joined context (HellaSwag's ctx is ctx_a + " " + ctx_b)
        ctx = _string(doc, "ctx", where)
    else:
        raise EvalError(f"{where}: no context (fields ctx_a and ctx_b, or ctx)")
    # lm-eval always prefixes the activity label; a file without one is scored on the context alone.
    query = preprocess(_string(doc, "activity_label", where) + ": " + ctx if "activity_label" in doc else ctx)
    endings = doc.get("endings")
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        raise EvalError(f"{where}: 'endings' must be a list of at least 2 strings (HellaSwag has 4)")
    label = doc.get("label")
    try:
        if isinstance(label, bool) or label is None or (isinstance(label, float) and not label.is_integer()):
            raise ValueError
        gold = int(label)
    except (TypeError, ValueError):
        raise EvalError(f"{where}: 'label' must be the index of the right ending, got {label!r} "
                        "(HellaSwag's test split is unlabelled: use the validation split)") from None
    if not 0 <= gold < len(endings):
        raise EvalError(f"{where}: 'label' {gold} is not an index into its {len(endings)} endings")
    return Example(query, tuple(preprocess(e) for e in endings), gold)


def load_hellaswag(path: str, limit: int = 0) -> list[Example]:
    """The examples of a HellaSwag-format JSON-lines file (local or any fsspec URL; .gz/.zst read as such).

    Blank lines are skipped; limit > 0 keeps the first that many. EvalError names a bad line.
    """
    examples: list[Example] = []
    try:
        with fsspec.open(path, "rt", compression="infer", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    raise EvalError(f"{path} line {n}: not JSON ({_one_line(e)})") from None
                examples.append(example_from(doc, f"{path} line {n}"))
                if limit and len(examples) >= limit:
                    break
    except FileNotFoundError:
        raise EvalError(f"HellaSwag file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise EvalError(f"{path}: not UTF-8 text ({_one_line(e)})") from None
    if not examples:
        raise EvalError(f"{path}: no examples")
    return examples


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


# --- scoring ----------------------------------------------------------------------


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's HFLM encodes a loglikelihood request."""
    if context == "":
        return [tokenizer.prefix_id], tokenizer.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    head = tokenizer.encode(context)
    # A merge across the boundary may take the context's last token: it is scored with the continuation.
    return head, whole[len(head):]


def _window(model: nn.Module, max_len: int | None) -> int:
    if max_len is not None:
        return max_len
    cfg = getattr(model, "cfg", None)
    if cfg is None or not getattr(cfg, "max_seq_len", 0):
        raise ValueError("pass max_len: the model has no cfg.max_seq_len")
    return int(cfg.max_seq_len)


@torch.no_grad()
def loglikelihoods(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]], batch: int = 16,
                   device: torch.device | str = "cpu", max_len: int | None = None) -> list[float]:
    """Sum of log p(continuation token | everything before it) for each (context, continuation) pair.

    Sequences longer than the model's window (max_len, default model.cfg.max_seq_len) lose their
    oldest tokens, as lm-eval truncates. Batches hold sequences of similar length (longest first),
    right-padded: the attention is causal, so the padding changes nothing before it.
    """
    window = _window(model, max_len)
    rows = []
    for context, continuation in requests:
        seq = (list(context) + list(continuation))[-(window + 1):]
        rows.append((seq[:-1], seq[1:], min(len(continuation), len(seq) - 1)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out = [0.0] * len(rows)
    was_training = model.training
    model.eval()
    try:
        for lo in range(0, len(order), max(1, batch)):
            chunk = order[lo:lo + max(1, batch)]
            width = len(rows[chunk[0]][0])
            inputs = torch.zeros(len(chunk), width, dtype=torch.long)
            targets = torch.full((len(chunk), width), IGNORE, dtype=torch.long)
            for r, i in enumerate(chunk):
                inp, tgt, n = rows[i]
                inputs[r, :len(inp)] = torch.tensor(inp)
                targets[r, len(inp) - n:len(inp)] = torch.tensor(tgt[len(tgt) - n:])
            with compute_precision(device):
                logits = model(inputs.to(device))
            # In fp32 whatever the autocast: a sum of hundreds of log-probs in bf16 would round away the differences.
            nll = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(), ignore_index=IGNORE,
                                  reduction="none")
            for r, value in enumerate((-nll.view(len(chunk), width).sum(1)).tolist()):
                out[chunk[r]] = value
    finally:
        model.train(was_training)
    return out


def choice_loglikelihoods(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch: int = 16,
                          device: torch.device | str = "cpu", max_len: int | None = None) -> list[list[float]]:
    """Each example's choices scored: the log-likelihood of " " + choice after its query (lm-eval's target_delimiter)."""
    requests = [encode_pair(tokenizer, ex.query, " " + choice) for ex in examples for choice in ex.choices]
    flat = loglikelihoods(model, requests, batch, device, max_len)
    scores, k = [], 0
    for ex in examples:
        scores.append(flat[k:k + len(ex.choices)])
        k += len(ex.choices)
    return scores


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # the first maximum, as np.argmax


def multiple_choice(model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch: int = 16,
                    device: torch.device | str = "cpu", max_len: int | None = None) -> dict[str, float]:
    """{"acc", "acc_norm", "n"} of model on examples, scored as lm-eval scores HellaSwag (module docstring)."""
    if not examples:
        raise EvalError("no multiple-choice examples to score")
    acc = acc_norm = 0
    for ex, scores in zip(examples, choice_loglikelihoods(model, tokenizer, examples, batch, device, max_len)):
        acc += _argmax(scores) == ex.gold
        # By characters, as lm-eval's completion_len = len(choice); an empty choice counts as 1 (lm-eval divides by 0).
        acc_norm += _argmax([s / max(1, len(c)) for s, c in zip(scores, ex.choices)]) == ex.gold
    n = len(examples)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n}


def check_vocab(tokenizer: Tokenizer, vocab_size: int) -> None:
    """A tokenizer whose ids the model has no row for would index past its embedding."""
    if tokenizer.vocab_size > vocab_size:
        raise EvalError(f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens, more than the model's "
                        f"vocabulary of {vocab_size}: it is not the tokenizer the model was trained with")


# --- the coordinator's periodic tasks -------------------------------------------------


def make_task_evaluator(cfg: RunConfig, device: torch.device | str = "cpu"
                        ) -> Callable[[dict[str, torch.Tensor]], dict[str, float]] | None:
    """Scores of the global parameters on the run's downstream tasks, or None when there are none.

    On with eval.hellaswag (a HellaSwag-format JSON-lines file, a path or fsspec URL) and
    eval.tasks_every_rounds > 0 (when to call it is the caller's: every that many rounds).
    eval.hellaswag_examples > 0 scores only the first that many. The file and the run's tokenizer
    (a token corpus's tokenizer.json, or bytes for text) are read here, once, so that a bad one stops
    the coordinator at start; call it after diloco.data.sources.resolve_vocab, as make_evaluator is. The
    returned function takes the model's state dict and gives {"hellaswag_acc", "hellaswag_acc_norm",
    "hellaswag_n"}; it builds no batch bigger than eval.batch_size sequences.
    """
    from diloco.models.llama import Transformer

    ev = cfg.eval
    if ev.tasks_every_rounds < 0 or ev.hellaswag_examples < 0:
        raise ConfigError("eval.tasks_every_rounds and eval.hellaswag_examples must be >= 0 (0: off, all)")
    if ev.tasks_every_rounds == 0 or not ev.hellaswag:
        if ev.hellaswag or ev.tasks_every_rounds:
            log.warning("downstream tasks are off: set both eval.hellaswag and eval.tasks_every_rounds")
        return None
    try:
        examples = load_hellaswag(ev.hellaswag, ev.hellaswag_examples)
        tokenizer = run_tokenizer(cfg.data)
        check_vocab(tokenizer, cfg.model.vocab_size)
    except EvalError as e:
        raise ConfigError(f"eval.hellaswag: {e}") from None
    model = Transformer(cfg.model).to(device)
    log.info("HellaSwag: %d examples from %s, scored every %d rounds (tokenizer: %s)", len(examples), ev.hellaswag,
             ev.tasks_every_rounds, tokenizer.name)

    def run(params: dict[str, torch.Tensor]) -> dict[str, float]:
        load_parameters(model, params)  # as make_evaluator: the global parameters, nothing else
        scores = multiple_choice(model, tokenizer, examples, ev.batch_size, device)
        return {"hellaswag_acc": scores["acc"], "hellaswag_acc_norm": scores["acc_norm"], "hellaswag_n": float(scores["n"])}

    return run
