"""What an island does next: one vocabulary, from the coordinator's refusal to what every rank agrees on.

`Next` is the one outcome type of the island. A refusal's typed reason
(diloco/wire/refusal.py, never the text of a message) maps to it in one table
below; a push reports it; at a landing the ranks of a group and the replica
groups agree on it by reducing its integer values with MAX, so the values are
ordered by severity and `Next(int(reduced))` reads the agreement back.
"""

from __future__ import annotations

import enum

import grpc

from diloco.wire.refusal import Reason, reason_of
from diloco.v1 import diloco_pb2 as pb


class Next(enum.IntEnum):
    """What to do next, least severe first (the order is what a MAX across ranks and groups picks by).

    At a landing, everything above DELIVERED ends in a resync of the fragment; REJOIN, RESET and RELEASE do
    their part first, so they rank above the plain ones. NOBODY is 0 so that the replica groups' SUM of the
    pushing group's report (the others add 0) is that report.
    """

    NOBODY = 0  # no push reported: a rank of a group that does not push; agreed by every group, a takeover
    DELIVERED = 1  # the push is there: ours, or a duplicate of what another replica group pushed
    WAIT = 2  # the round is still open, waiting for other islands: wait on
    PUSH_AGAIN = 3  # the coordinator holds no contribution from us (it restarted): resend the same chunks
    FINISHED = 4  # the run is over
    RESYNC = 5  # fetch the current global parameters and train for the coordinator's round
    REJOIN = 6  # the coordinator forgot us: join again under our id, then resync
    RESET = 7  # our pseudo-gradient was not finite: fresh inner optimizer and error feedback, then resync
    RELEASE = 8  # our samples are not ours (the coordinator forgot our leases): drop them, take new ones, resync
    FAIL = 9  # nothing to retry: misconfiguration or another release; raised to the user, never agreed on


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
    Reason.REPLACED: Next.FAIL,  # another process joined as this island: this one stops (REPLACED_EXIT)
}
assert set(_NEXT) == set(Reason.values()), "every refusal reason needs an island decision"


# The exit status of an island process that stops because another process joined as the island (REPLACED): not 0
# (it did not finish the run), and not 2 (diloco/cli/common.py fail: bad input, a refusal no restart mends), so that
# a supervisor can tell "replaced, do not restart me" from a failure.
REPLACED_EXIT = 3


def next_step(error: grpc.RpcError) -> Next:
    return _NEXT[reason_of(error)]


def reason_name(error: grpc.RpcError) -> str:
    return pb.Refusal.Reason.Name(reason_of(error))
