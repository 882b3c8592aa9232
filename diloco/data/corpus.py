"""The text `diloco-data prepare` reads: input files, their documents, batches of them, the eval split.

Inputs are fsspec URLs (local paths or s3://...), globs or directories (every file under them),
each expanded in sorted order. `.gz` and `.zst`/`.zstd` files are decompressed. A file named
*.jsonl, *.ndjson or *.json (before the compression suffix) is JSON lines: one document per
non-empty line, its text in `text_field`. Any other file is plain UTF-8 text cut into documents
by `text_docs`: "blank" (default: documents are separated by blank lines, so a paragraph or a
play's speech is one), "line" (one document per line) or "file" (the whole file is one).
Documents that are empty or only whitespace are skipped.

A document is held out for the eval split when the XXH3-64 of its UTF-8 text falls below
`eval_fraction` of the hash range: a choice that depends on nothing but the text, so neither the
number of workers nor the order of the inputs changes it, and duplicates land on the same side.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import xxhash

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
TEXT_DOCS = ("blank", "line", "file")
BATCH_CHARS = 1 << 18  # text per tokenization task: enough to amortize the IPC, small enough to spread
BATCH_DOCS = 4096


class InputError(ValueError):
    """Inputs that cannot be read as asked; the message names the file and what to change."""


@dataclass(frozen=True)
class InputFile:
    url: str
    size: int


@dataclass(frozen=True)
class Position:
    """Where reading resumes: the input file's index, and how many of its documents are already done."""

    file: int = 0
    doc: int = 0


@dataclass(frozen=True)
class Batch:
    docs: list[str]
    end: Position  # the position just after this batch's last document


def list_inputs(patterns: list[str], storage_options: dict | None = None) -> list[InputFile]:
    """Every input file the patterns name, each pattern's matches sorted, in the patterns' order."""
    files: list[InputFile] = []
    seen = set()
    for pattern in patterns:
        fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
        if any(c in path for c in "*?["):
            paths = sorted(fs.glob(path))
        elif fs.isdir(path):
            paths = sorted(fs.find(path))
        elif fs.exists(path):
            paths = [path]
        else:
            raise InputError(f"input {pattern} does not exist")
        paths = [p for p in paths if not fs.isdir(p)]
        if not paths:
            raise InputError(f"input {pattern} matches no file")
        for p in paths:
            url = fs.unstrip_protocol(p) if "://" in pattern else p
            if url not in seen:
                seen.add(url)
                files.append(InputFile(url, int(fs.size(p))))
    return files


def is_jsonl(url: str) -> bool:
    name = url.lower()
    for suffix in COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    return name.endswith(JSONL_SUFFIXES)


def documents(url: str, text_field: str = "text", text_docs: str = "blank",
              storage_options: dict | None = None) -> Iterator[str]:
    """The non-empty documents of one input file, in order."""
    with fsspec.open(url, "rt", compression="infer", encoding="utf-8", errors="replace",
                     **(storage_options or {})) as f:
        if is_jsonl(url):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                except (ValueError, KeyError, TypeError) as e:
                    raise InputError(f"{url} line {n}: no string field {text_field!r} in a JSON object "
                                     f"({type(e).__name__}); pick the field with --text-field") from None
                if not isinstance(text, str):
                    raise InputError(f"{url} line {n}: field {text_field!r} is {type(text).__name__}, not text")
                if text.strip():
                    yield text
        elif text_docs == "file":
            text = f.read()
            if text.strip():
                yield text
        elif text_docs == "line":
            for line in f:
                if line.strip():
                    yield line.rstrip("\n")
        else:
            lines: list[str] = []
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines)
                    lines = []
            if lines:
                yield "".join(lines)


def batches(files: list[InputFile], start: Position = Position(), text_field: str = "text",
            text_docs: str = "blank", storage_options: dict | None = None) -> Iterator[Batch]:
    """The documents from start on, in batches that never span two files (so a batch end is a resume point)."""
    for f in range(start.file, len(files)):
        skip = start.doc if f == start.file else 0
        docs: list[str] = []
        chars, n = 0, 0
        for n, text in enumerate(documents(files[f].url, text_field, text_docs, storage_options), 1):
            if n <= skip:
                continue
            docs.append(text)
            chars += len(text)
            if chars >= BATCH_CHARS or len(docs) >= BATCH_DOCS:
                yield Batch(docs, Position(f, n))
                docs, chars = [], 0
        if n < skip:
            raise InputError(f"{files[f].url} has {n} documents, fewer than the {skip} already prepared: "
                             "did it change since? Start again with an empty output")
        yield Batch(docs, Position(f + 1, 0))


def is_eval(text: str, eval_fraction: float) -> bool:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "replace")) < eval_fraction * 2.0**64
