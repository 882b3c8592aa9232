"""The audit log: who did what to the run, as JSON lines at an fsspec URL (a local folder or s3://bucket/prefix).

One record per join, completed push, leave, refusal (with its typed reason, the
method and the caller's certificate name and address), lease expiry and
revocation. One file per process run, `audit-<start>.jsonl`, rotated by size
into `audit-<start>-1.jsonl`, ..., each record written as it comes (uploaded
at once to an object store; diloco/jsonlog.py, whose read_log reads them in order).
"""

from __future__ import annotations

import time

from diloco.jsonlog import JsonLines


class AuditLog:
    def __init__(self, url: str, flush_s: float = 5.0):
        self.lines = JsonLines(url, "audit", flush_s)
        self.url = self.lines.url

    def record(self, event: str, **fields) -> None:
        self.lines.write({"time": round(time.time(), 3), "event": event, **fields})

    def flush(self) -> None:
        self.lines.flush()

    def close(self) -> None:
        self.lines.close()


class NoAudit:
    """No --audit: records go nowhere."""

    def record(self, event: str, **fields) -> None:
        pass

    def close(self) -> None:
        pass
