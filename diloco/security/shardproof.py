"""What a coordinator's shards show each other on their own calls (docs/sharding.md): a proof, under the shards'
shared secret, that binds who calls whom, what for, the request itself, and when.

A proof is "<unix seconds>:<HMAC-SHA256>" over the purpose ("judge", "leader reads"), the calling shard, the shard
called, the time, and a SHA-256 of the request (its type, and its fields but the proof). So a proof seen on a captured
link is good for that one request only (a forged body under it is refused), from and to those shards only, and for
MAX_AGE_S either side of the time it was made (the shards' clocks must agree within that).
"""

from __future__ import annotations

import hashlib
import hmac
import time

from google.protobuf.message import Message

MAX_AGE_S = 300.0  # a proof's life either side of its time: the clock skew the shards' hosts may have, and a retry's


def body_digest(request: Message, proof_field: str) -> str:
    """SHA-256 of the request's type and the request serialized without its proof field (deterministically: map
    entries in order). The type: two requests of different types may serialize alike (both empty)."""
    body = type(request)()
    body.CopyFrom(request)
    body.ClearField(proof_field)
    return hashlib.sha256(request.DESCRIPTOR.full_name.encode() + b"\n" + body.SerializeToString(deterministic=True)).hexdigest()


def _mac(secret: bytes, purpose: str, caller: int, callee: int, at: int, digest: str) -> str:
    text = "\n".join(map(str, ("diloco shard proof", purpose, caller, callee, at, digest)))
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def seal(secret: bytes, purpose: str, caller: int, callee: int, request: Message, proof_field: str,
         now: float | None = None) -> str:
    """The proof for request, sent by shard `caller` to shard `callee`; made for each call (it expires)."""
    at = int(time.time() if now is None else now)
    return f"{at}:{_mac(secret, purpose, caller, callee, at, body_digest(request, proof_field))}"


def refusal(secret: bytes, purpose: str, caller: int, callee: int, request: Message, proof_field: str,
            max_age_s: float = MAX_AGE_S, now: float | None = None) -> str | None:
    """Why the request's proof does not hold (one line), or None when it does: made with the secret for this purpose,
    caller, callee and body, within max_age_s of now."""
    presented = getattr(request, proof_field)
    at_text, _, mac = presented.partition(":")
    if not presented or not at_text.isdigit() or len(at_text) > 12 or not mac:
        return "no shard proof (a proof is made by the coordinator's own shards with DILOCO_SHARD_SECRET)"
    at = int(at_text)
    if not hmac.compare_digest(_mac(secret, purpose, caller, callee, at, body_digest(request, proof_field)), mac):
        return ("its shard proof does not hold for this request (another secret, another shard, or a body it was not "
                "made for)")
    age = (time.time() if now is None else now) - at
    if abs(age) > max_age_s:
        return (f"its shard proof was made {age:.0f} s from now, beyond {max_age_s:.0f} s: expired, or the shards' "
                "clocks disagree (keep them in sync, e.g. NTP)")
    return None
