"""Strings a client sent, made safe to keep and to log.

A hostname, key or reason string arrives as whatever the client put in it: a
megabyte, a newline followed by a forged log line, terminal escapes. Whatever
the coordinator keeps (records, the dashboard, checkpoints) or logs goes
through bounded() first: one printable line of at most `limit` characters.
"""

from __future__ import annotations

HOSTNAME_MAX = 253  # the longest DNS name (RFC 1035)
KEY_MAX = 128  # an island key (replica groups of one island join under it)
ID_MAX = 64  # an island id as a caller names it ("island-12"; longer ones are never ours)
CHECKSUM_MAX = 64  # a checksum as an island reports it (ours are 16 hex digits)
_CUT = "..."


def bounded(text: str, limit: int) -> str:
    """text as one printable line of at most limit characters: control characters (newlines, carriage returns,
    escapes, Unicode line separators) written as Python escapes (\\n, \\x1b, \\u2028), and a longer text cut to
    limit characters ending in '...'."""
    head = text[: limit + 1]  # enough to tell whether it is longer: the work stays O(limit) whatever was sent
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in head)
    if len(safe) <= limit and len(head) == len(text):
        return safe
    return safe[: max(0, limit - len(_CUT))] + _CUT
