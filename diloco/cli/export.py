"""`diloco-export`: a run's newest committed coordinator checkpoint as a Hugging Face Llama folder.

    diloco-export runs/demo/ckpt/coordinator hf/demo   # after `diloco-sim --workdir runs/demo`
    diloco-export runs/ckpt hf/my-run                  # after `diloco-coordinator serve --checkpoint runs/ckpt`
    diloco-export s3://bucket/run/ckpt hf/run --step 40 --shard-gb 2

The folder loads with transformers (AutoModelForCausalLM / LlamaForCausalLM, and AutoTokenizer for a
run on a token corpus); diloco/models/export.py says what it holds.
"""

from __future__ import annotations

import argparse
import logging
import sys

PROG = "diloco-export"
# diloco.models.export's DTYPES and SHARD_BYTES, restated (tests/test_export.py checks they agree): the module
# imports torch, which `--help` and a bad flag should not wait for.
DTYPE_NAMES = ("bfloat16", "float32")
SHARD_GB = 5.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT_URL",
                   help="the coordinator's checkpoint.url (a local path or s3://bucket/prefix)")
    p.add_argument("out", metavar="OUT_DIR", help="the model folder to write (must be empty or absent, unless --force)")
    p.add_argument("--step", type=int, help="export this committed step (default: the newest committed one)")
    p.add_argument("--shard-gb", type=float, default=SHARD_GB,
                   help="split the weights into safetensors shards of at most this many GB (default %(default)g)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="the weights' dtype (default %(default)s)")
    p.add_argument("--config", help="the run's config TOML, for checkpoints that do not record it (checked against "
                                    "the checkpoint's config digest)")
    p.add_argument("--corpus", help="where the run's token corpus is now, when its data.url does not reach it from here "
                                    "(the tokenizer comes from it)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it holds anything")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.shard_gb <= 0:
        print(f"{PROG}: error: --shard-gb must be > 0", file=sys.stderr)
        return 2
    from diloco.models.export import ExportError, export

    try:
        done = export(args.checkpoint, args.out, step=args.step, shard_bytes=int(args.shard_gb * 1e9), force=args.force,
                      config_path=args.config, corpus_url=args.corpus, dtype=args.dtype)
    except ExportError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint {done.step} ({done.parameters / 1e6:.2f}M parameters) -> {done.folder}: {', '.join(done.files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
