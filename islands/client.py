"""An island's connection to the coordinator: join, heartbeat, fetch, push, pull, leave."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping

import grpc
import torch

from diloco.codec import Codec
from diloco.params import checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire import PROTOCOL_VERSION, Manifest, apply_chunks, tensor_chunks

log = logging.getLogger(__name__)

# Transient failures worth another try; anything else is the caller's problem.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}


class CoordinatorUnreachable(ConnectionError):
    pass


class CoordinatorClient:
    def __init__(self, address: str, connect_timeout_s: float = 30.0, retries: int = 5):
        self.address = address
        self.retries = retries
        self.channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {address} within {connect_timeout_s:.0f}s; "
                "check the address and that `diloco-coordinator serve` is running"
            ) from None
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5.0)
        self.channel.close()

    def _retry(self, what: str, call):
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                return call()
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or attempt == self.retries:
                    raise
                log.warning("%s failed (%s: %s); retrying in %.1fs", what, e.code().name, e.details(), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def join(self, config_digest: str = "") -> pb.JoinResponse:
        request = pb.JoinRequest(config_digest=config_digest, hostname=socket.gethostname(), protocol_version=PROTOCOL_VERSION)
        return self._retry("join", lambda: self.stub.Join(request, timeout=60))

    def start_heartbeat(self, island_id: str, interval_s: float, round_of: callable) -> None:
        def beat() -> None:
            while not self._heartbeat_stop.wait(interval_s):
                try:
                    self.stub.Heartbeat(pb.HeartbeatRequest(island_id=island_id, round=round_of()), timeout=max(interval_s, 5))
                except grpc.RpcError as e:
                    log.warning("heartbeat failed: %s %s", e.code().name, e.details())

        self._heartbeat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat.start()

    def _receive(self, stream: Iterator[pb.ResultMessage], targets: Mapping[str, torch.Tensor], manifest: Manifest, codec: Codec) -> pb.ResultHeader:
        header = None

        def chunks():
            nonlocal header
            for message in stream:
                self.bytes_received += message.ByteSize()
                if message.HasField("header"):
                    header = message.header
                else:
                    yield message.chunk

        written = apply_chunks(chunks(), targets, manifest, codec)
        if header is None or written != manifest.total_numel():
            raise grpc_error(grpc.StatusCode.DATA_LOSS, f"parameter stream ended early ({written} of {manifest.total_numel()} elements)")
        if checksum(targets) != header.checksum:
            raise grpc_error(grpc.StatusCode.DATA_LOSS, "received parameters do not match the coordinator's checksum")
        return header

    def fetch(self, island_id: str, targets: Mapping[str, torch.Tensor], manifest: Manifest, codec: Codec) -> pb.ResultHeader:
        """Overwrites targets with the current global parameters; returns their header."""
        return self._retry(
            "fetch",
            lambda: self._receive(self.stub.FetchParameters(pb.FetchRequest(island_id=island_id)), targets, manifest, codec),
        )

    def pull(self, island_id: str, round_: int, targets, manifest: Manifest, codec: Codec, timeout_s: float) -> pb.ResultHeader:
        """Waits for round_ to close, then overwrites targets with the new global parameters."""
        request = pb.PullRequest(island_id=island_id, round=round_, timeout_s=timeout_s)
        return self._retry(
            "pull",
            lambda: self._receive(self.stub.PullRoundResult(request, timeout=timeout_s + 60), targets, manifest, codec),
        )

    def push(self, header: pb.PushHeader, pseudo_gradient: Mapping[str, torch.Tensor], codec: Codec, chunk_bytes: int) -> pb.PushResponse:
        def messages() -> Iterator[pb.PushMessage]:
            yield pb.PushMessage(header=header)
            for chunk in tensor_chunks(pseudo_gradient, codec, chunk_bytes):
                message = pb.PushMessage(chunk=chunk)
                self.bytes_sent += message.ByteSize()
                yield message

        return self._retry("push", lambda: self.stub.PushPseudoGradient(messages(), timeout=600))

    def leave(self, island_id: str, params_checksum: str, round_: int) -> bool:
        try:
            reply = self.stub.Leave(pb.LeaveRequest(island_id=island_id, checksum=params_checksum, round=round_), timeout=30)
            return reply.checksum_matches
        except grpc.RpcError as e:
            log.warning("leave failed: %s %s", e.code().name, e.details())
            return False


class _LocalRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


def grpc_error(code: grpc.StatusCode, details: str) -> grpc.RpcError:
    """An RpcError raised on our side (a bad stream), handled like the server's own."""
    return _LocalRpcError(code, details)
