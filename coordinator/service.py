"""gRPC adapter: turns diloco.v1.Coordinator calls into CoordinatorState calls."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from coordinator.state import CoordinatorState, Refused
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire import PROTOCOL_VERSION, tensor_chunks

log = logging.getLogger(__name__)


def _refusals(method):
    """Maps Refused to the gRPC status it names, with its message."""

    def wrapper(self, request, context):
        try:
            result = method(self, request, context)
            if hasattr(result, "__next__"):
                return self._stream_guard(result, context)
            return result
        except Refused as e:
            context.abort(e.code, str(e))

    wrapper.__name__ = method.__name__
    return wrapper


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, stop: threading.Event):
        self.state = state
        self.stop = stop

    def _stream_guard(self, stream: Iterator, context: grpc.ServicerContext) -> Iterator:
        try:
            yield from stream
        except Refused as e:
            context.abort(e.code, str(e))

    @_refusals
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        cfg = self.state.cfg
        if request.protocol_version != PROTOCOL_VERSION:
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} is not {PROTOCOL_VERSION}; run the same diloco release everywhere",
            )
        if request.config_digest and request.config_digest != cfg.digest():
            raise Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"config mismatch: the island's config digest is {request.config_digest}, the coordinator's is "
                f"{cfg.digest()}; start the island with the coordinator's config file, or without --config to adopt it",
            )
        island = self.state.join(request.hostname or context.peer())
        return pb.JoinResponse(
            island_id=island.island_id,
            config_digest=cfg.digest(),
            config_toml=cfg.to_toml(),
            round=self.state.round,
            parameters=self.state.manifest.to_proto(),
            codec=self.state.codec.name,
            max_chunk_bytes=cfg.wire.chunk_bytes,
            heartbeat_interval_s=cfg.rounds.heartbeat_s,
            shard_index=island.shard,
            total_rounds=cfg.rounds.rounds,
        )

    @_refusals
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        self.state.touch(request.island_id)
        return pb.HeartbeatResponse(round=self.state.round, run_finished=self.state.phase.value == "finished")

    def _parameters(self) -> Iterator[pb.ResultMessage]:
        with self.state.reading() as (header, params):
            sent = 0
            message = pb.ResultMessage(header=header)
            sent += message.ByteSize()
            yield message
            for chunk in tensor_chunks(params, self.state.codec, self.state.cfg.wire.chunk_bytes):
                message = pb.ResultMessage(chunk=chunk)
                sent += message.ByteSize()
                yield message
        self.state.count_down(header.round, sent)

    @_refusals
    def FetchParameters(self, request: pb.FetchRequest, context) -> Iterator[pb.ResultMessage]:
        if request.island_id:
            self.state.touch(request.island_id)
        return self._parameters()

    @_refusals
    def PushPseudoGradient(self, request_iterator: Iterator[pb.PushMessage], context) -> pb.PushResponse:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a push must start with a PushHeader")
        header = first.header

        def chunks() -> Iterator:
            for message in request_iterator:
                if not message.HasField("chunk"):
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "only chunks may follow the PushHeader")
                yield message.chunk

        return self.state.receive(header, chunks())

    @_refusals
    def PullRoundResult(self, request: pb.PullRequest, context) -> Iterator[pb.ResultMessage]:
        self.state.touch(request.island_id)
        self.state.wait_for_round_after(request.round, request.timeout_s or 600.0)
        return self._parameters()

    @_refusals
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        return pb.LeaveResponse(checksum_matches=self.state.leave(request.island_id, request.checksum))

    def WatchRounds(self, request: pb.WatchRequest, context) -> Iterator[pb.RoundSummary]:
        yield from self.state.watch(request.from_round, self.stop)

