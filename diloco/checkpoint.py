"""Checkpoints on any fsspec URL (a local path or s3://bucket/prefix), committed atomically.

Layout under the URL: one folder per step, `step-0000000042/`, holding
`state.pt` (torch.save of nested dicts of tensors and plain values),
`meta.json`, and last a `COMMITTED` marker with the size and SHA-256 of
state.pt. A folder step (begin_files/commit_files: files written by others,
e.g. torch.distributed.checkpoint's ranks) has a marker listing every file
and its size instead. A step without its marker, or whose state.pt does not match it, was
torn by a crash and is never loaded. Object stores have no atomic rename, so the
marker written last is what makes a checkpoint exist.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import re
from typing import Any

import fsspec
import torch

from diloco.progress import WORTH_SHOWING, Progress

log = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d{10})$")
MARKER = "COMMITTED"
_PIECE = 8 << 20  # state.pt is written and read in pieces of this size (progress on a terminal)


class CheckpointError(OSError):
    """A checkpoint that cannot be read or written; the message says where and why."""


class CheckpointStore:
    def __init__(self, url: str, keep_last: int = 3, storage_options: dict | None = None):
        if not url:
            raise CheckpointError("a checkpoint location is needed (a local path or s3://bucket/prefix)")
        self.url = url.rstrip("/")
        self.keep_last = keep_last
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/")
        self.progress = True  # large saves and loads show progress on a terminal (diloco/progress.py)

    def _progress(self, label: str, total: int) -> Progress:
        return Progress(label, total, enabled=self.progress and total >= WORTH_SHOWING)

    def _dir(self, step: int) -> str:
        return f"{self.root}/step-{step:010d}"

    def _all_steps(self) -> list[int]:
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            m = _STEP.search(entry.rstrip("/"))
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return [s for s in self._all_steps() if self.fs.exists(f"{self._dir(s)}/{MARKER}")]

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> str:
        """Writes state and metadata, then the commit marker; prunes old steps. Returns the step's URL."""
        where = self._dir(step)
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        data = buffer.getvalue()
        try:
            # Re-saving a step: un-commit it first so a crash mid-write leaves it torn, not mixed.
            self.fs.rm(f"{where}/{MARKER}") if self.fs.exists(f"{where}/{MARKER}") else None
            self.fs.makedirs(where, exist_ok=True)
            with self.fs.open(f"{where}/state.pt", "wb") as f, self._progress(f"writing checkpoint {step}", len(data)) as p:
                view = memoryview(data)
                for lo in range(0, len(data), _PIECE):
                    f.write(view[lo:lo + _PIECE])
                    p.update(min(_PIECE, len(data) - lo))
            with self.fs.open(f"{where}/meta.json", "w") as f:
                f.write(json.dumps(meta, indent=1, default=str))
            marker = {"step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            self._commit(where, marker)
        except OSError as e:
            raise CheckpointError(f"could not write checkpoint {step} to {self.url}: {e}") from e
        self._prune(step)
        return f"{self.url}/step-{step:010d}"

    def _commit(self, where: str, marker: dict[str, Any]) -> None:
        """Writes the step's commit marker so that it is whole whenever it exists: under another name, then moved
        (a rename on a local disk; an object appears whole on S3). A process killed while writing it leaves the step
        uncommitted; before, the marker could exist empty, and a coordinator resuming from it failed to parse it."""
        writing = f"{where}/{MARKER}.writing"
        with self.fs.open(writing, "w") as f:
            f.write(json.dumps(marker))
        self.fs.mv(writing, f"{where}/{MARKER}")

    def load(self, step: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """(tensors, meta) of a committed step; by default the newest one that verifies.

        A committed step whose data does not match its marker (storage that lost
        or damaged a file) is skipped with a warning in favour of the one before.
        """
        return self._first_usable(self._load, step)

    def _first_usable(self, read, step: int | None):
        """read(step), or read() of the newest committed step that verifies."""
        if step is not None:
            return read(step)
        steps = self.steps()
        for candidate in reversed(steps):
            try:
                return read(candidate)
            except CheckpointError as e:
                log.warning("skipping checkpoint: %s", e)
        raise CheckpointError(
            f"no usable checkpoint under {self.url}" + (f" ({len(steps)} committed, none verified)" if steps else "")
        )

    def load_meta(self, step: int | None = None) -> dict[str, Any] | None:
        """Only the metadata of a committed step (default: the newest); None when there is none."""
        step = self.latest() if step is None else step
        if step is None:
            return None
        with self.fs.open(f"{self._dir(step)}/meta.json", "r") as f:
            return json.loads(f.read())

    def _load(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        where = self._dir(step)
        try:
            with self.fs.open(f"{where}/{MARKER}", "r") as f:
                marker = json.loads(f.read())
            with self.fs.open(f"{where}/state.pt", "rb") as f, self._progress(f"reading checkpoint {step}", marker["bytes"]) as p:
                data = _read_whole(f, marker["bytes"], p)
            with self.fs.open(f"{where}/meta.json", "r") as f:
                meta = json.loads(f.read())
        except (FileNotFoundError, ValueError, KeyError) as e:  # ValueError: a marker or meta that is not whole JSON
            raise CheckpointError(f"checkpoint {step} under {self.url} is not committed or incomplete: {e}") from e
        if len(data) != marker["bytes"] or hashlib.sha256(data).hexdigest() != marker["sha256"]:
            raise CheckpointError(f"checkpoint {step} under {self.url} does not match its commit marker (corrupt)")
        tensors = torch.load(_BufferFile(data), map_location="cpu", weights_only=True)
        return tensors, meta

    # --- folder steps: the files are written by someone else (torch.distributed.checkpoint's ranks) ---

    def step_url(self, step: int) -> str:
        return f"{self.url}/step-{step:010d}"

    def begin_files(self, step: int) -> str:
        """Un-commits and empties step's folder for writers to fill; returns its URL.

        Until commit_files() the step is torn and never loaded.
        """
        where = self._dir(step)
        try:
            if self.fs.exists(f"{where}/{MARKER}"):
                self.fs.rm(f"{where}/{MARKER}")  # first, so a crash while clearing leaves it torn, not mixed
            if self.fs.exists(where):
                self.fs.rm(where, recursive=True)
            self.fs.makedirs(where, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"could not prepare checkpoint {step} at {self.url}: {e}") from e
        return self.step_url(step)

    def commit_files(self, step: int, meta: dict[str, Any]) -> str:
        """Once every file of the step is written: meta.json, then the marker listing every file and its size."""
        where = self._dir(step)
        try:
            with self.fs.open(f"{where}/meta.json", "w") as f:
                f.write(json.dumps(meta, indent=1, default=str))
            self._commit(where, {"step": step, "files": self._files(step)})
        except OSError as e:
            raise CheckpointError(f"could not commit checkpoint {step} at {self.url}: {e}") from e
        self._prune(step)
        return self.step_url(step)

    def load_files(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """(step, meta) of a committed folder step whose files all match its marker; by default the newest."""
        return self._first_usable(lambda s: (s, self._verify_files(s)), step)

    def step_bytes(self, step: int) -> int:
        """The size of everything in step's folder (its files as they are now)."""
        return sum(self._files(step).values())

    def _files(self, step: int) -> dict[str, int]:
        where = self._dir(step)
        self.fs.invalidate_cache(where)
        found = self.fs.find(where, detail=True)
        return {p[len(where) + 1 :]: int(info["size"]) for p, info in found.items() if not p.endswith(f"/{MARKER}")}

    def _verify_files(self, step: int) -> dict[str, Any]:
        where = self._dir(step)
        try:
            with self.fs.open(f"{where}/{MARKER}", "r") as f:
                marker = json.loads(f.read())
            with self.fs.open(f"{where}/meta.json", "r") as f:
                meta = json.loads(f.read())
        except (FileNotFoundError, ValueError) as e:  # ValueError: a marker or meta that is not whole JSON
            raise CheckpointError(f"checkpoint {step} under {self.url} is not committed or incomplete: {e}") from e
        if "files" not in marker:
            raise CheckpointError(f"checkpoint {step} under {self.url} is a single-file checkpoint, not a folder one")
        found = self._files(step)
        bad = sorted(n for n, size in marker["files"].items() if found.get(n) != size)
        if bad:
            raise CheckpointError(f"checkpoint {step} under {self.url} does not match its commit marker: {', '.join(bad)} missing or resized")
        return meta

    def _prune(self, newest: int) -> None:
        """Keeps the keep_last newest committed steps; removes older ones and torn leftovers."""
        committed = self.steps()
        keep = set(committed[-self.keep_last :])
        for step in self._all_steps():
            if step in keep or step > newest:
                continue
            try:
                self.fs.rm(self._dir(step), recursive=True)
            except FileNotFoundError:
                pass


def _read_whole(f, expected: int, progress: Progress) -> bytearray:
    """The rest of file f, read in pieces into one buffer of the expected size (more or less if it differs)."""
    data = bytearray(expected)
    view, n = memoryview(data), 0
    while n < expected and (got := f.readinto(view[n:n + _PIECE])):
        n += got
        progress.update(got)
    del view
    if n < expected:
        del data[n:]
    else:
        data += f.read()  # a file longer than its marker says: its length tells
    return data


class _BufferFile(io.RawIOBase):
    """A bytearray as a read-only file, without the copy io.BytesIO would make of it."""

    def __init__(self, data: bytearray):
        self.view, self.pos = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (0 if whence == io.SEEK_SET else self.pos if whence == io.SEEK_CUR else len(self.view))
        return self.pos

    def tell(self) -> int:
        return self.pos


def rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states (CPU and, when present, CUDA)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
