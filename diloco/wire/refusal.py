"""Typed refusals: why the coordinator turned a call down, as data both sides read the same way.

The coordinator attaches a `Refusal` (protos/) to every non-OK status, in the
binary trailing metadata entry REFUSAL_KEY; islands branch on its reason and
never on the status message, which is for people. Each reason has exactly one
gRPC status code (STATUS below), so a generic gRPC client still sees a
sensible status.
"""

from __future__ import annotations

import grpc

from diloco.v1 import diloco_pb2 as pb

Reason = pb.Refusal.Reason
REFUSAL_KEY = "diloco-refusal-bin"
MAX_MESSAGE = 1000  # characters of a refusal's message

_C = grpc.StatusCode
STATUS: dict[int, grpc.StatusCode] = {
    Reason.PROTOCOL_MISMATCH: _C.FAILED_PRECONDITION,
    Reason.CONFIG_MISMATCH: _C.FAILED_PRECONDITION,
    Reason.CODEC_MISMATCH: _C.FAILED_PRECONDITION,
    Reason.RUN_FINISHED: _C.FAILED_PRECONDITION,
    Reason.RUN_FULL: _C.RESOURCE_EXHAUSTED,
    Reason.NOT_A_MEMBER: _C.NOT_FOUND,
    Reason.ROUND_CLOSED: _C.FAILED_PRECONDITION,
    Reason.ROUND_AHEAD: _C.FAILED_PRECONDITION,
    Reason.PUSH_AGAIN: _C.FAILED_PRECONDITION,
    Reason.DUPLICATE: _C.ALREADY_EXISTS,
    Reason.CHECKSUM_MISMATCH: _C.FAILED_PRECONDITION,
    Reason.BAD_CHUNK: _C.INVALID_ARGUMENT,
    Reason.CORRUPT_CHUNK: _C.DATA_LOSS,
    Reason.NOT_FINITE: _C.INVALID_ARGUMENT,
    Reason.DROPPED: _C.FAILED_PRECONDITION,
    Reason.STILL_OPEN: _C.DEADLINE_EXCEEDED,
    Reason.BAD_REQUEST: _C.INVALID_ARGUMENT,
    Reason.NOT_LEASED: _C.FAILED_PRECONDITION,
    Reason.NOT_YOURS: _C.PERMISSION_DENIED,
    Reason.REVOKED: _C.PERMISSION_DENIED,
    Reason.TOO_MANY_STREAMS: _C.RESOURCE_EXHAUSTED,
    Reason.STREAM_IDLE: _C.DEADLINE_EXCEEDED,
    Reason.RATE_LIMITED: _C.RESOURCE_EXHAUSTED,
    Reason.SPOOL_FULL: _C.RESOURCE_EXHAUSTED,
    Reason.REPLACED: _C.FAILED_PRECONDITION,
}
assert set(STATUS) == set(Reason.values()) - {Reason.REASON_UNSPECIFIED}, "every reason needs its status code"


class Refused(Exception):
    """A call the coordinator turns down: a typed reason (which fixes the gRPC status) and a message for people."""

    def __init__(self, reason: int, message: str, resend_from_chunk: int = 0, current_round: int = 0, config_toml: str = ""):
        # Messages quote what the caller sent (ids, names): a long one would push the status past gRPC's
        # metadata limit and the caller would get neither the status nor the reason.
        super().__init__(message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "...")
        self.reason = reason
        self.refusal = pb.Refusal(reason=reason, resend_from_chunk=resend_from_chunk, current_round=current_round,
                                  config_toml=config_toml)
        self.code = STATUS[reason]

    @property
    def trailing(self) -> tuple:
        return trailing_metadata(self.refusal)


def name(reason: int) -> str:
    return Reason.Name(reason)


def status_of(reason: int) -> grpc.StatusCode:
    """The reason's status code; UNKNOWN for none (a failure found on the caller's side that no reason names)."""
    return STATUS.get(reason, _C.UNKNOWN)


def trailing_metadata(refusal: pb.Refusal) -> tuple[tuple[str, bytes], ...]:
    return ((REFUSAL_KEY, refusal.SerializeToString()),)


def refusal_of(error: grpc.RpcError) -> pb.Refusal:
    """The Refusal an error carries; REASON_UNSPECIFIED when it carries none (a transport failure)."""
    carried = getattr(error, "refusal", None)
    if isinstance(carried, pb.Refusal):
        return carried
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in metadata or ():
        if key == REFUSAL_KEY:
            try:
                return pb.Refusal.FromString(value)
            except Exception:  # a malformed entry is no refusal at all
                break
    return pb.Refusal()


def reason_of(error: grpc.RpcError) -> int:
    return refusal_of(error).reason


def is_transport_failure(error: grpc.RpcError) -> bool:
    """No refusal, and the status says the coordinator could not be reached (restarting, network)."""
    return reason_of(error) == Reason.REASON_UNSPECIFIED and error.code() == grpc.StatusCode.UNAVAILABLE
