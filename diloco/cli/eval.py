"""`diloco-eval`: held-out loss and perplexity of a coordinator checkpoint or an exported folder, on
text or token data, and multiple-choice accuracy on HellaSwag-format JSON lines (diloco/models/evaluation.py).

  diloco-eval CHECKPOINT_OR_FOLDER [--text FILE | --tokens URL] [--hellaswag FILE.jsonl] [--batches N] [--json OUT]

CHECKPOINT_OR_FOLDER is a coordinator's checkpoint.url (its newest committed step; local or s3://),
one step-NNNNNNNNNN folder under it, or an exported Hugging Face folder (config.json). A coordinator
checkpoint records its run's config (older ones only its digest: give the run's --config and --set
overrides, without which the embedded default is tried); a config of another digest is refused,
so the model is always built as the run built it.

Held-out data: --text FILE (the tail a run on that file holds out, data.eval_fraction, 0.1:
--set data.eval_fraction=1 for all of it), --tokens URL (a corpus's eval split), or by default a
checkpoint's own run's held-out set, the batches its coordinator evaluates on. --batches 0 skips it.

Text (--text, --hellaswag) is read with the model's tokenizer: --tokenizer FILE, else --tokens' corpus's,
an exported folder's tokenizer.json, a checkpoint's run's (its token corpus's; bytes for a text run),
else bytes for a model of 256 tokens. A model of another vocabulary with none of these is refused
(--tokenizer bytes says it was trained on bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from diloco.cli.common import ArgumentParser, add_config_flags, fail, setup_logging

# torch, fsspec and the model's modules (diloco/models/checkpoint_eval.py) are imported once the arguments are
# checked: `--help` and a bad flag answer at once.

PROG = "diloco-eval"


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="CHECKPOINT_OR_FOLDER",
                   help="a coordinator's checkpoint.url or one step folder of it (local or s3://), or an exported folder")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--text", metavar="FILE",
                      help="held-out text: the file's held-out tail (data.eval_fraction), in the model's tokens")
    data.add_argument("--tokens", metavar="URL", help="a token corpus made by `diloco-data prepare`: its eval split")
    p.add_argument("--hellaswag", metavar="FILE.jsonl", help="multiple-choice accuracy on a HellaSwag-format file")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="score only the file's first N examples")
    p.add_argument("--tokenizer", metavar="FILE",
                   help="the model's tokenizer.json for --text and --hellaswag, or 'bytes' for a byte-level model "
                        "(default: the folder's, the run's corpus's, or bytes for a vocabulary of 256)")
    p.add_argument("--batches", type=int, metavar="N",
                   help="held-out batches (default: the run's eval.batches, else 8; 0: no held-out loss)")
    p.add_argument("--batch-size", type=int, metavar="B", help="sequences per forward (default: the run's eval.batch_size)")
    p.add_argument("--seq-len", type=int, metavar="L",
                   help="held-out window (default: the run's data.seq_len; an exported model's max_seq_len)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON to OUT (a path or fsspec URL)")
    p.add_argument("--log-level", default="warning", help="logging level (default %(default)s)")
    add_config_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.log_level)
    for flag in ("limit", "batches", "batch_size", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag in ("limit", "batches") else 1):
            fail(PROG, f"--{flag.replace('_', '-')} must be >= {0 if flag in ('limit', 'batches') else 1}, got {value}")
    import fsspec

    from diloco.checkpoint import CheckpointError
    from diloco.config import ConfigError
    from diloco.data.shards import DataError
    from diloco.models.checkpoint_eval import evaluate
    from diloco.models.evaluation import EvalError

    try:
        report = evaluate(args)
        if args.json:
            with fsspec.open(args.json, "w") as f:
                f.write(json.dumps(report, indent=1) + "\n")
    except (EvalError, ConfigError, CheckpointError, DataError, OSError) as e:
        fail(PROG, " ".join(str(e).split()))  # one line, whatever the exception put in it
    sys.stdout.write(table(report, skipped=args.batches == 0))
    return 0


def table(report: dict[str, Any], skipped: bool = False) -> str:
    where = report["source"]
    if report["kind"] == "checkpoint":
        where += f"  step {report['step']} (round {report['round']})"
    lines = [f"{'model':<14}{where}, {report['parameters'] / 1e6:.2f}M parameters"]
    held = report["heldout"]
    if held is None:
        lines.append(f"{'held-out':<14}none ({'--batches 0' if skipped else 'give --text FILE or --tokens URL'})")
    else:
        lines += [f"{'held-out':<14}{held['data']}: {held['batches']} batches of {held['batch_size']} x {held['seq_len']}",
                  f"  {'loss':<12}{held['loss']:.4f} nats/token",
                  f"  {'perplexity':<12}{held['perplexity']:.4g}",
                  f"  {'tokens':<12}{held['tokens']:,}"]
    mc = report["hellaswag"]
    if mc is not None:
        lines += [f"{'hellaswag':<14}{mc['file']} (tokenizer: {mc['tokenizer']})",
                  f"  {'acc':<12}{mc['acc']:.4f}", f"  {'acc_norm':<12}{mc['acc_norm']:.4f}", f"  {'n':<12}{mc['n']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
