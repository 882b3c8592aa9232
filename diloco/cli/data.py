"""`diloco-data`: prepare token data from text (`prepare`), or check a dataset (`inspect`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import fsspec
import xxhash

from diloco.data.bpe import TokenizerError
from diloco.data.corpus import InputError
from diloco.data.mds import find_mds_index, known_hashes
from diloco.data.prepare import PrepareConfig, PrepareError, prepare
from diloco.data.shards import BLOCK_BYTES, MANIFEST, DataError, read_manifest
from diloco.data.shardstore import CHUNK, Shard, check_hashes, hasher


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
        try:
            return inspect(args.url, verify=not args.no_verify)
        except DataError as e:
            print(f"diloco-data: {e}", file=sys.stderr)
            return 1
    if args.train_tokenizer and args.vocab_size is None:
        p.error("--train-tokenizer needs --vocab-size N")
    if args.tokenizer and args.vocab_size is not None:
        p.error("--vocab-size is for --train-tokenizer; a given tokenizer has its own")
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


def inspect(url: str, verify: bool = True) -> int:
    """Prints the dataset's summary; with verify, downloads every shard and checks it. 1 if any is bad."""
    url = url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    shards: list[tuple[Shard, tuple[str, ...] | None, int]] = []
    if fs.exists(f"{root}/{MANIFEST}"):
        manifest, _ = read_manifest(url)
        print(f"{url}: diloco tokens, vocab_size {manifest.vocab_size}, eos_id {manifest.eos_id} "
              f"({manifest.eos_token!r}), {manifest.dtype.name}, tokenizer sha256 {manifest.tokenizer_sha256[:16]}")
        for name, split in sorted(manifest.splits.items()):
            print(f"  {name}: {split.tokens} tokens, {split.documents} documents, {len(split.shards)} shards, "
                  f"{sum(s.bytes for s in split.shards)} bytes")
            shards += [(Shard(f"{url}/{s.file}", f"{root}/{s.file}", s.bytes, s.tokens, {"xxh3_128": s.xxh3_128}),
                        s.blocks_xxh3_64, manifest.block_bytes) for s in split.shards]
    else:
        indexes = {split: find_mds_index(fs, root, split) for split in ("train", "eval")}
        if not any(indexes.values()):
            raise DataError(f"{url}: no {MANIFEST} (ours) or index.json (MDS)")
        for split, index in indexes.items():
            if index is None:
                continue
            infos = json.loads(fs.cat_file(index))["shards"]
            base = index.rsplit("/", 1)[0]
            print(f"{fs.unstrip_protocol(index)}: MDS, {len(infos)} shards, {sum(i['samples'] for i in infos)} samples, "
                  f"columns {infos[0]['column_names'] if infos else []} {infos[0]['column_encodings'] if infos else []}, "
                  f"compression {infos[0].get('compression') if infos else None}")
            for info in infos:
                file = info["zip_data"] if info.get("compression") else info["raw_data"]
                shards.append((Shard(fs.unstrip_protocol(f"{base}/{file['basename']}"), f"{base}/{file['basename']}",
                                     int(file["bytes"]), 0, known_hashes(file.get("hashes"))), None, BLOCK_BYTES))
    if not verify:
        return 0
    bad = 0
    for shard, blocks, block_bytes in shards:
        try:
            verify_shard(fs, shard, blocks, block_bytes)
        except DataError as e:
            bad += 1
            print(f"  BAD {e}")
    print(f"  verified {len(shards) - bad} of {len(shards)} shards" + (f"; {bad} bad" if bad else ""))
    return 1 if bad else 0


def verify_shard(fs, shard: Shard, blocks: tuple[str, ...] | None, block_bytes: int) -> None:
    """Downloads one shard (streaming) and checks its size, checksums and block checksums."""
    hashers = {a: hasher(a) for a in shard.hashes}
    n, k, carry = 0, 0, b""
    try:
        with fs.open(shard.path, "rb", block_size=CHUNK) as f:
            while chunk := f.read(CHUNK):
                n += len(chunk)
                for h in hashers.values():
                    h.update(chunk)
                if blocks is not None:
                    carry += chunk
                    while len(carry) >= block_bytes:
                        _check_block(shard, blocks, k, carry[:block_bytes])
                        carry, k = carry[block_bytes:], k + 1
    except FileNotFoundError:
        raise DataError(f"{shard.url}: missing") from None
    if n != shard.nbytes:
        raise DataError(f"{shard.url}: {n} bytes, expected {shard.nbytes}")
    if blocks is not None and (carry or k == 0):
        _check_block(shard, blocks, k, carry)
    check_hashes(shard, {a: h.hexdigest() for a, h in hashers.items()})


def _check_block(shard: Shard, blocks: tuple[str, ...], k: int, data: bytes) -> None:
    if k >= len(blocks) or xxhash.xxh3_64_hexdigest(data) != blocks[k]:
        raise DataError(f"{shard.url}: checksum mismatch in block {k}")


if __name__ == "__main__":
    sys.exit(main())
