"""The audit log: who did what to the run, as JSON lines at an fsspec URL (a local folder or s3://bucket/prefix).

One record per join, completed push, leave, refusal (with its typed reason, the
method and the caller's certificate name and address), lease expiry and
revocation. Object stores cannot append, so the log is a series of parts,
`audit-<start>-<n>.jsonl`, each written whole: every `flush_s` seconds while
records come in, and at close. A part is never rewritten; reading the parts in
name order gives the records in order.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import fsspec

log = logging.getLogger(__name__)


class AuditLog:
    def __init__(self, url: str, flush_s: float = 5.0):
        self.fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
        self.root = root.rstrip("/")
        self.fs.makedirs(self.root, exist_ok=True)
        self.url, self.flush_s = url.rstrip("/"), flush_s
        self.started = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        self.parts = 0
        self.pending: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._flusher, name="audit", daemon=True)
        self.thread.start()

    def record(self, event: str, **fields) -> None:
        line = json.dumps({"time": round(time.time(), 3), "event": event, **fields}, sort_keys=True, default=str)
        with self.lock:
            self.pending.append(line)

    def _flusher(self) -> None:
        while not self.stop.wait(self.flush_s):
            self.flush()

    def flush(self) -> None:
        with self.lock:
            lines, self.pending = self.pending, []
            if not lines:
                return
            part = self.parts
            self.parts += 1
        path = f"{self.root}/audit-{self.started}-{part:06d}.jsonl"
        try:
            with self.fs.open(path, "w") as f:
                f.write("\n".join(lines) + "\n")
        except Exception as e:  # the run goes on; the records stay queued for the next flush
            log.error("could not write the audit log to %s (%s); keeping %d records for the next try", path, e, len(lines))
            with self.lock:
                self.pending[:0] = lines

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5.0)
        self.flush()


class NoAudit:
    """No --audit: records go nowhere."""

    def record(self, event: str, **fields) -> None:
        pass

    def close(self) -> None:
        pass
