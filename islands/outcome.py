"""What an island does next when the coordinator refuses a call: one table, read by every island loop.

Decided on the refusal's typed reason (diloco/refusal.py), never on the text
of a message.
"""

from __future__ import annotations

import enum

import grpc

from diloco.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb


class Next(enum.Enum):
    RESYNC = "resync"  # fetch the current global parameters and train for the coordinator's round
    REJOIN = "rejoin"  # the coordinator forgot us: join again under our id, then resync
    RESET = "reset"  # our pseudo-gradient was not finite: fresh inner optimizer and error feedback, then resync
    RELEASE = "release"  # our samples are not ours (the coordinator forgot our leases): drop them, take new ones, resync
    PUSH_AGAIN = "push again"  # the coordinator holds no contribution from us (it restarted): resend the same chunks
    DELIVERED = "delivered"  # a duplicate: what we pushed is there already (another replica group's copy)
    WAIT = "wait"  # the round is still open, waiting for other islands: wait on
    FINISHED = "finished"  # the run is over
    FAIL = "fail"  # nothing to retry: misconfiguration or another release; raise to the user


_NEXT: dict[int, Next] = {
    Reason.REASON_UNSPECIFIED: Next.FAIL,  # a transport failure that outlasted the client's retries
    Reason.PROTOCOL_MISMATCH: Next.FAIL,
    Reason.CONFIG_MISMATCH: Next.FAIL,
    Reason.CODEC_MISMATCH: Next.FAIL,
    Reason.RUN_FULL: Next.FAIL,
    Reason.BAD_REQUEST: Next.FAIL,
    Reason.RUN_FINISHED: Next.FINISHED,
    Reason.NOT_A_MEMBER: Next.REJOIN,
    Reason.ROUND_CLOSED: Next.RESYNC,
    Reason.ROUND_AHEAD: Next.RESYNC,
    Reason.CHECKSUM_MISMATCH: Next.RESYNC,
    Reason.DROPPED: Next.RESYNC,
    Reason.BAD_CHUNK: Next.RESYNC,
    Reason.CORRUPT_CHUNK: Next.RESYNC,  # the client resent already; still broken: start the round over
    Reason.NOT_FINITE: Next.RESET,
    Reason.PUSH_AGAIN: Next.PUSH_AGAIN,
    Reason.DUPLICATE: Next.DELIVERED,
    Reason.STILL_OPEN: Next.WAIT,
    Reason.NOT_LEASED: Next.RELEASE,
    Reason.NOT_YOURS: Next.FAIL,
    Reason.REVOKED: Next.FAIL,
    Reason.TOO_MANY_STREAMS: Next.RESYNC,  # never an honest island's: its round is lost, it goes on
    Reason.STREAM_IDLE: Next.RESYNC,  # our push stalled past limits.push_idle_s: that round is lost
    Reason.RATE_LIMITED: Next.RESYNC,  # never an honest island's (joins or heartbeats far too often)
    Reason.SPOOL_FULL: Next.RESYNC,  # the coordinator's disk is full: this round is lost, the next may fit
}
assert set(_NEXT) == set(Reason.values()), "every refusal reason needs an island decision"


def next_step(error: grpc.RpcError) -> Next:
    return _NEXT[reason_of(error)]


def reason_name(error: grpc.RpcError) -> str:
    return pb.Refusal.Reason.Name(reason_of(error))
