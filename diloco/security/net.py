"""Addresses: which ones stay on this machine (plaintext is allowed there without --insecure)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost."""
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
