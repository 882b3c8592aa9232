"""Logs as JSON lines at an fsspec URL (a local folder or s3://bucket/prefix), and TensorBoard beside them.

Object stores cannot append, so a log is a series of parts,
`<prefix>-<start>-<n>.jsonl`, each written whole: every `flush_s` seconds while
records come in, and at close. A part is never rewritten; reading the parts in
name order gives the records in order. A part that cannot be written is kept
for the next flush (the process goes on).

Records are made JSON-safe: NaN and infinities become null (JSON has neither),
anything else json cannot take becomes its str().

Used by the coordinator's audit log (coordinator/audit.py) and round log
(coordinator/runlog.py), and by an island's telemetry (islands/telemetry.py).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

import fsspec
from google.protobuf.message import Message

log = logging.getLogger(__name__)

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


class JsonLines:
    """Records appended in memory, written as whole parts `<prefix>-<start>-<n>.jsonl` under url. Thread-safe."""

    def __init__(self, url: str, prefix: str, flush_s: float = 5.0, storage_options: dict | None = None):
        if not url:
            raise LogError("a log location is needed (a local folder or s3://bucket/prefix)")
        self.url, self.prefix, self.flush_s = url.rstrip("/"), prefix, flush_s
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
            self.root = root.rstrip("/")
            self.fs.makedirs(self.root, exist_ok=True)
        except (OSError, ValueError, ImportError) as e:
            raise LogError(f"cannot write logs to {url}: {e}") from e
        self.started = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.parts = 0
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._flusher, name=f"log-{prefix}", daemon=True)
        self.thread.start()

    def write(self, record: dict[str, Any]) -> None:
        """Queues one record (one line); written at the next flush."""
        line = json.dumps(json_safe(record), sort_keys=True, default=str, allow_nan=False)
        with self.lock:
            self.pending.append(line)

    def _flusher(self) -> None:
        while not self.stop.wait(self.flush_s):
            self.flush()

    def part_path(self, part: int) -> str:
        return f"{self.root}/{self.prefix}-{self.started}-{part:06d}.jsonl"

    def flush(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
            if not lines:
                return
            part = self.parts
            self.parts += 1
        path = self.part_path(part)
        try:
            with self.fs.open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
        except Exception as e:  # the process goes on; the records stay queued for the next flush
            log.error("could not write the %s log to %s (%s); keeping %d records for the next try", self.prefix, path, e, len(lines))
            with self.lock:
                self.pending[:0] = lines

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)
        self.flush()


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
