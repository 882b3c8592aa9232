"""`diloco-data`: prepare token data from text (`prepare`), or check a dataset (`inspect`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

# The data modules (numpy, torch) are imported once the arguments are checked: `--help` and a bad flag answer at once.


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco-data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    pre = sub.add_parser("prepare", help="tokenize text into token shards and a manifest at an fsspec URL")
    pre.add_argument("inputs", nargs="+", help="text or JSON-lines files (.gz/.zst too), local or s3://, globs or folders")
    pre.add_argument("-o", "--output", required=True, help="where the dataset goes (a local path or s3://bucket/prefix)")
    tok = pre.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="a Hugging Face tokenizers tokenizer.json, used as is")
    tok.add_argument("--train-tokenizer", action="store_true", help="train a byte-level BPE on the corpus")
    pre.add_argument("--vocab-size", type=int, help="the trained tokenizer's vocabulary size (with --train-tokenizer)")
    pre.add_argument("--eos-token", default="<|endoftext|>", help="the end-of-document token (default %(default)s)")
    pre.add_argument("--text-field", default="text", help="the text's field in JSON lines (default %(default)s)")
    pre.add_argument("--text-docs", choices=("blank", "line", "file"), default="blank",
                     help="how plain text is cut into documents: at blank lines (default), per line, or per file")
    pre.add_argument("--eval-fraction", type=float, default=0.005,
                     help="fraction of documents held out for eval, chosen by a hash of their text (default %(default)s)")
    pre.add_argument("--shard-tokens", type=int, default=1 << 24, help="tokens per shard (default %(default)s)")
    pre.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: every core)")
    ins = sub.add_parser("inspect", help="print a dataset's summary and verify every shard's checksum")
    ins.add_argument("url", help="the dataset (ours: manifest.json; MDS: index.json)")
    ins.add_argument("--no-verify", action="store_true", help="only the summary; download nothing else")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "inspect":
        from diloco.data.inspect import inspect
        from diloco.data.shardstore import DataError

        try:
            return inspect(args.url, verify=not args.no_verify)
        except DataError as e:
            print(f"diloco-data: {e}", file=sys.stderr)
            return 1
    if args.train_tokenizer and args.vocab_size is None:
        p.error("--train-tokenizer needs --vocab-size N")
    if args.tokenizer and args.vocab_size is not None:
        p.error("--vocab-size is for --train-tokenizer; a given tokenizer has its own")
    from diloco.data.bpe import TokenizerError
    from diloco.data.corpus import InputError
    from diloco.data.prepare import PrepareConfig, PrepareError, prepare

    cfg = PrepareConfig(inputs=args.inputs, output=args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                        eos_token=args.eos_token, text_field=args.text_field, text_docs=args.text_docs,
                        eval_fraction=args.eval_fraction, shard_tokens=args.shard_tokens, workers=args.workers,
                        progress=sys.stderr.isatty())
    try:
        manifest = prepare(cfg)
    except (PrepareError, InputError, TokenizerError) as e:
        p.error(str(e))
    for name, split in sorted(manifest.splits.items()):
        print(f"{name}: {split.tokens} tokens, {split.documents} documents, {len(split.shards)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
