"""Logs as JSON lines at an fsspec URL (a local folder or s3://bucket/prefix), and TensorBoard beside them.

One file per process run, `<prefix>-<start>.jsonl` (start: the UTC second the log
opened), rotated past a size into `<prefix>-<start>-1.jsonl`, `-2.jsonl`, ...,
as torchtitan's and the HF Trainer's logs are one file per process. read_log
gives a log's records in the order written (a name sort puts `-1` before the
first part).

- A local folder: each record is appended and flushed to the OS as it is
  written, so a process that crashes loses at most the record being written.
  Files rotate at ROTATE_BYTES.
- An object store (s3://...) cannot append: the current part is kept in memory
  and uploaded whole, by a thread woken at each record (the writer never waits
  on the store), so a crash loses at most the records of the upload under way,
  usually the last. Each upload rewrites the part, so parts rotate sooner, at
  OBJECT_ROTATE_BYTES. A part that was uploaded whole is never rewritten.

A write that fails is logged and keeps its records for the next try (at the
next record or close; on a store also every flush_s); the process goes on.

Records are made JSON-safe: NaN and infinities become null (JSON has neither),
anything else json cannot take becomes its str().

Used by the coordinator's audit log (coordinator/audit.py) and round log
(coordinator/runlog.py), and by an island's telemetry (islands/telemetry.py).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from google.protobuf.message import Message

log = logging.getLogger(__name__)

# A local log file's size before the next part: large, as a log rotated by size is (RotatingFileHandler's users pick
# tens of MB); round records are a few kB, so a run rarely reaches a second part.
ROTATE_BYTES = 64 * 2**20
# An object store's: every upload rewrites the current part whole, so a smaller part bounds each upload's bytes.
OBJECT_ROTATE_BYTES = 8 * 2**20

TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install tensorboard (or pip install 'diloco[tensorboard]')"


class LogError(ValueError):
    """A log that cannot be opened as asked; the message says what to do."""


def json_safe(value: Any) -> Any:
    """value with NaN and infinities as None, tuples as lists, recursively (dicts, lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def message_dict(message: Message) -> dict[str, Any]:
    """Every field of a protobuf message (defaults included) as plain Python values, recursively.

    Unlike json_format.MessageToDict, int64s stay numbers and field names stay as the proto spells them."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        is_message = field.type == field.TYPE_MESSAGE
        if is_message and field.message_type.GetOptions().map_entry:  # a map: keys to scalars
            out[field.name] = dict(value)
        elif field.is_repeated:
            out[field.name] = [message_dict(v) if is_message else v for v in value]
        elif is_message:
            out[field.name] = message_dict(value) if message.HasField(field.name) else None
        else:
            out[field.name] = value
    return out


def log_name(prefix: str, started: str, part: int) -> str:
    """A log file's name: `<prefix>-<start>.jsonl`, then `<prefix>-<start>-<part>.jsonl` once rotated."""
    return f"{prefix}-{started}{f'-{part}' if part else ''}.jsonl"


_LOG_NAME = re.compile(r"(?P<prefix>.+)-(?P<started>\d{8}T\d{6})(?:-(?P<part>\d+))?\.jsonl")


def read_log(url: str, prefix: str, storage_options: dict | None = None) -> list[dict[str, Any]]:
    """Every record of the logs `<prefix>-*.jsonl` under url, in the order written: each process run's by its start,
    its parts in order."""
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"), **(storage_options or {}))
    files = []
    for path in fs.ls(root, detail=False):
        m = _LOG_NAME.fullmatch(path.rsplit("/", 1)[-1])
        if m and m["prefix"] == prefix:
            files.append((m["started"], int(m["part"] or 0), path))
    return [json.loads(line) for *_, path in sorted(files) for line in fs.cat_file(path).decode().splitlines()]


class JsonLines:
    """Records as JSON lines, one file per process run under url, rotated by size (the module's docstring).
    Thread-safe. prefix may change until the first record is written (an island learns its name at join)."""

    def __init__(self, url: str, prefix: str, flush_s: float = 5.0, storage_options: dict | None = None,
                 rotate_bytes: int | None = None):
        if not url:
            raise LogError("a log location is needed (a local folder or s3://bucket/prefix)")
        self.url, self.prefix, self.flush_s = url.rstrip("/"), prefix, flush_s
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
            self.root = root.rstrip("/")
            self.fs.makedirs(self.root, exist_ok=True)
        except (OSError, ValueError, ImportError) as e:
            raise LogError(f"cannot write logs to {url}: {e}") from e
        self.appends = isinstance(self.fs, LocalFileSystem)  # else an object store: parts uploaded whole
        self.rotate_bytes = rotate_bytes or (ROTATE_BYTES if self.appends else OBJECT_ROTATE_BYTES)
        self.started = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.part = 0  # the current file's part number
        self.part_bytes = 0  # its size, the records not written yet included
        self.pending: list[str | None] = []  # lines not written yet, None where a part ends (appending)
        self.lines: list[str] = []  # every line of the current part (uploading)
        self.sealed: list[tuple[str, str]] = []  # (path, text) of full parts not uploaded yet
        self.dirty = False  # the current part has lines its stored copy lacks (uploading)
        self.file = None  # the open local file (appending)
        self.lock = threading.Lock()  # the buffers above
        self.storing = threading.Lock()  # one write to storage at a time, in the order of the records
        self.stop = threading.Event()
        self.wake = threading.Event()
        self.thread = None
        if not self.appends:
            self.thread = threading.Thread(target=self._uploader, name=f"log-{prefix}", daemon=True)
            self.thread.start()

    def path(self, part: int) -> str:
        return f"{self.root}/{log_name(self.prefix, self.started, part)}"

    def write(self, record: dict[str, Any]) -> None:
        """Writes one record (one line): appended at once to a local file; uploaded at once, by a thread, to a store."""
        line = json.dumps(json_safe(record), sort_keys=True, default=str, allow_nan=False)
        size = len(line.encode()) + 1
        with self.lock:
            if self.part_bytes and self.part_bytes + size > self.rotate_bytes:
                self._rotate()
            self.part_bytes += size
            if self.appends:
                self.pending.append(line)
            else:
                self.lines.append(line)
                self.dirty = True
        if self.appends:
            self.flush()
        else:
            self.wake.set()

    def _rotate(self) -> None:
        """Starts the next part (under self.lock). A full part still uploading is kept whole until it is stored."""
        if self.appends:
            self.pending.append(None)  # where the file changes: written in order by flush()
        else:
            self.sealed.append((self.path(self.part), "\n".join(self.lines) + "\n"))
            self.lines, self.dirty = [], False
        self.part += 1
        self.part_bytes = 0

    def flush(self) -> None:
        """Writes what is not in storage yet; a failure is logged and kept for the next try."""
        with self.storing:
            if self.appends:
                self._append()
            else:
                self._upload()

    def _append(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
            part = self.part - lines.count(None)  # the part the first of them belongs to
        try:
            for k, line in enumerate(lines):
                if line is None:  # rotated
                    self._close_file()
                    part += 1
                    continue
                if self.file is None:
                    self.file = self.fs.open(self.path(part), "a")
                self.file.write(line + "\n")
                self.file.flush()  # to the OS: a crash of this process loses none of it
        except Exception as e:  # the process goes on; the lines not written stay for the next try
            log.error("could not write the %s log to %s (%s); keeping %d records for the next try", self.prefix,
                      self.path(part), e, sum(1 for x in lines[k:] if x is not None))
            self._close_file()  # reopened (appending) at the next try
            with self.lock:
                self.pending[:0] = lines[k:]

    def _close_file(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except Exception:  # a file that failed to write may fail to close too; it is reopened
                pass
            self.file = None

    def _upload(self) -> None:
        with self.lock:
            sealed = list(self.sealed)
            current = (self.path(self.part), "\n".join(self.lines) + "\n") if self.dirty else None
            self.dirty = False
        try:
            for path, text in sealed:
                self.fs.pipe_file(path, text.encode())
                with self.lock:
                    self.sealed.pop(0)
            if current is not None:
                self.fs.pipe_file(current[0], current[1].encode())
        except Exception as e:  # the process goes on; the part is uploaded again at the next try
            log.error("could not write the %s log to %s (%s); trying again with the next record or in %gs",
                      self.prefix, self.url, e, self.flush_s)
            with self.lock:
                self.dirty = self.dirty or current is not None

    def _uploader(self) -> None:
        while not self.stop.is_set():
            self.wake.wait(self.flush_s)  # a record came, or a failed upload is due again
            self.wake.clear()
            self.flush()

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        if self.thread is not None:
            self.thread.join(5.0)
        self.flush()
        with self.storing:
            self._close_file()


def tensorboard_writer(logdir: str, config_toml: str = "", tag: str = "config", flush_s: float = 30.0):
    """A torch.utils.tensorboard SummaryWriter at logdir (written every flush_s seconds and at close) with the
    run's config as text; LogError without the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise LogError(TENSORBOARD_MISSING) from e
    writer = SummaryWriter(log_dir=logdir, flush_secs=max(1, int(flush_s)))
    if config_toml:
        # Markdown: indented four spaces, the TOML shows as a code block.
        writer.add_text(tag, "\n".join("    " + line for line in config_toml.splitlines()), 0)
        writer.flush()
    return writer


def check_tensorboard() -> None:
    """Raises LogError(TENSORBOARD_MISSING) when tensorboard is not installed (before a run starts)."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise LogError(TENSORBOARD_MISSING)
