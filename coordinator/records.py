"""Small records the round machines share: refusals, phases, contributions, closed rounds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc

from coordinator.spool import Spool
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import Coverage

ACCEPTED_CHUNKS_KEY = "diloco-accepted-chunks"


class Refused(Exception):
    """A call the coordinator turns down; code is the gRPC status to return."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple = ()):
        super().__init__(message)
        self.code = code
        self.trailing = trailing


class Phase(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    FINISHED = "finished"


@dataclass
class Contribution:
    """One island's pseudo-gradient for one round, possibly pushed over several streams."""

    tokens: int
    train_loss: float
    coverage: Coverage
    spools: list[Spool] = field(default_factory=list)
    state: str = "pending"  # pending -> folding -> committed


@dataclass
class Closed:
    """What the driver learns when a round closed."""

    summary: pb.RoundSummary
    total_rounds: int  # rounds closed so far over every fragment (the checkpoint step)
    run_finished: bool
