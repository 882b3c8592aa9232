"""Chunk messages on the hot path, framed by hand instead of through protobuf objects.

Every round a model's worth of chunks goes up (PushMessage.chunk) and comes
back (ResultMessage.chunk). Through protobuf objects each payload is copied
several times: into a TensorChunk, into its wrapper, out again when serialized;
on receipt into upb's arena and again whenever `.payload` is read. Here:

- serialized_values: the bytes of the published values' ResultMessages with
  one copy of the parameters (the coordinator, once a round);
- frame_chunk / push_frames: any chunk message (an island's push, a result's
  delta or mean chunk) from its fields with one copy of the payload: wrapping a
  TensorChunk in its PushMessage or ResultMessage copies it through upb at
  under 1 GB/s (0.72 s of a 125M fp32 push);
- parse_chunk_message: a received message that holds only a chunk, as a
  ChunkView whose payload is a view of the bytes gRPC handed over (no copy);
  anything else, or anything it is not sure of, is left to protobuf.

All speak exactly the protocol of protos/: the framing gives
SerializeToString()'s bytes, and a ChunkView reads as the parsed TensorChunk
would (tests/test_frames.py compares them on random and damaged messages).
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import grpc
import torch

from diloco.wire.codec import get_codec
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import chunk_spans, framed_size, payload_digest

_LITTLE_ENDIAN = sys.byteorder == "little"  # fp32 values are their own payload
_FIXED64 = struct.Struct("<Q")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(0x80 | (n & 0x7F))
        n >>= 7
    out.append(n)
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk to send: a TensorChunk's fields, its payload kept out of protobuf until frame_chunk frames it."""

    name: str
    offset: int
    numel: int
    payload: bytes | memoryview
    xxh3: int


def chunk_of(name: str, offset: int, numel: int, payload: bytes | memoryview) -> Chunk:
    """make_chunk's fields without the TensorChunk: its digest over the payload."""
    return Chunk(name, offset, numel, payload, payload_digest(payload))


def frame_chunk(field: int, chunk, name: bytes | None = None) -> bytes:
    """The bytes of a message whose one field (number < 16) holds this chunk (a TensorChunk, Chunk or ChunkView),
    as SerializeToString() writes them: fields in number order, defaults left out. name: the chunk's name
    encoded already (the caller framing many chunks of one parameter)."""
    encoded = chunk.name.encode() if name is None else name
    payload = chunk.payload  # a TensorChunk's is copied out once here; the others' are views
    offset, numel, digest = chunk.offset, chunk.numel, chunk.xxh3
    if offset < 0 or numel < 0:  # int64 below zero: ten-byte varints, never ours; protobuf frames them
        message = pb.TensorChunk(name=chunk.name, offset=offset, numel=numel, payload=bytes(payload), xxh3=digest)
        return bytes([field << 3 | 2]) + _varint(message.ByteSize()) + message.SerializeToString()
    head = b"\x0a" + _varint(len(encoded)) + encoded if encoded else b""  # 1: name
    head += (b"\x10" + _varint(offset) if offset else b"") + (b"\x18" + _varint(numel) if numel else b"")  # 2: offset, 3: numel
    head += b"\x22" + _varint(len(payload)) if len(payload) else b""  # 4: payload
    tail = b"\x31" + _FIXED64.pack(digest) if digest else b""  # 6: xxh3 (fixed64)
    size = len(head) + len(payload) + len(tail)
    return b"".join((bytes([field << 3 | 2]) + _varint(size), head, payload, tail))


def push_frames(header: pb.PushHeader, chunks: Iterable) -> Iterator[bytes]:
    """wire.push_messages serialized: the header, each chunk framed by hand, the PushEnd."""
    yield pb.PushMessage(header=header).SerializeToString()
    n = 0
    for chunk in chunks:
        n += 1
        yield frame_chunk(2, chunk)  # PushMessage field 2: chunk
    yield pb.PushMessage(end=pb.PushEnd(chunks=n)).SerializeToString()


def serialized(message: object) -> bytes:
    """A gRPC serializer for streams of messages some of which are framed already (bytes)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def fp32_payload(piece: torch.Tensor) -> bytes | memoryview:
    """A flat fp32 CPU tensor's payload in the fp32 codec: on a little-endian host, a view of its own memory (framing
    copies it once; Fp32Codec.encode would copy it once more)."""
    if _LITTLE_ENDIAN and piece.dtype == torch.float32 and piece.device.type == "cpu" and piece.is_contiguous():
        return memoryview(piece.detach().numpy()).cast("B")
    return get_codec("fp32").encode(piece)


def serialized_values(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> Iterator[bytes]:
    """The bytes of ResultMessage(chunk=...) for the fp32 values of tensors, chunked as tensor_chunks(fp32) chunks
    them, with one copy of the values."""
    fp32 = get_codec("fp32")
    for name, t in tensors.items():
        flat = t.detach().reshape(-1)
        encoded = name.encode()
        for start, end in chunk_spans(flat.numel(), fp32, chunk_bytes):
            piece = flat[start:end]
            yield frame_chunk(2, chunk_of(name, start, piece.numel(), fp32_payload(piece)), encoded)  # ResultMessage field 2: chunk


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A received TensorChunk, read like one; its payload is a view of the message's bytes."""

    name: str
    offset: int
    numel: int
    payload: memoryview
    xxh3: int
    field: int  # the wrapper's field that held it (ResultMessage: 2 chunk, 3 mean_chunk)
    size: int  # bytes of the whole message


def _read_varint(raw: bytes, i: int, end: int) -> tuple[int, int]:
    """(value, next position); raises IndexError or ValueError where protobuf might read it otherwise."""
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise ValueError("varint")
        b = raw[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def _int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >> 63 else v


def parse_chunk_message(raw: bytes, chunk_fields: tuple[int, ...]) -> ChunkView | None:
    """The chunk of a message holding exactly one field, one of chunk_fields, that is a TensorChunk whose fields
    each appear at most once; None for anything else (the caller parses it with protobuf, which also gives
    the errors)."""
    try:
        tag, i = _read_varint(raw, 0, len(raw))
        length, i = _read_varint(raw, i, len(raw))
        if tag & 7 != 2 or tag >> 3 not in chunk_fields or i + length != len(raw):
            return None
        fields: dict[int, object] = {}
        while i < len(raw):
            key, i = _read_varint(raw, i, len(raw))
            number, wire_type = key >> 3, key & 7
            if number in fields:
                return None
            if wire_type == 0 and number in (2, 3):  # offset, numel: int64
                value, i = _read_varint(raw, i, len(raw))
                fields[number] = _int64(value)
            elif wire_type == 2 and number in (1, 4):  # name, payload
                n, i = _read_varint(raw, i, len(raw))
                if i + n > len(raw):
                    return None
                fields[number] = memoryview(raw)[i : i + n]
                i += n
            elif wire_type == 1 and number == 6:  # xxh3: fixed64
                if i + 8 > len(raw):
                    return None
                fields[number] = _FIXED64.unpack_from(raw, i)[0]
                i += 8
            else:
                return None
        name = bytes(fields.get(1, b"")).decode("utf-8")  # strict, as protobuf is for a string field
    except (ValueError, IndexError):
        return None
    return ChunkView(name, fields.get(2, 0), fields.get(3, 0), fields.get(4, memoryview(b"")), fields.get(6, 0),
                     tag >> 3, len(raw))


def result_chunk(message) -> tuple[object, int, bool]:
    """(the chunk, its message's bytes, whether it is a mean chunk) of a ResultMessage after the header, or of
    the ChunkView it was parsed into."""
    if isinstance(message, ChunkView):
        return message, message.size, message.field == 3
    mean = message.HasField("mean_chunk")
    chunk = message.mean_chunk if mean else message.chunk
    return chunk, framed_size(chunk), mean


class ResultStreamError(ValueError):
    """A result stream out of order: chunks after its trailer, or no checksum anywhere."""


class ResultRest:
    """A result stream after its header: iterating gives the parameter chunks; the mean chunks (eager updates) and the
    trailer (a result streamed while the update was made) are kept aside as they pass. counted: each message's
    bytes."""

    def __init__(self, messages: Iterable, counted: Callable[[int], None]):
        self.messages, self.counted = messages, counted
        self.mean: list = []
        self.trailer: pb.ResultTrailer | None = None

    def __iter__(self) -> Iterator:
        for message in self.messages:
            if self.trailer is not None:
                raise ResultStreamError("result stream goes on after its trailer")
            if not isinstance(message, ChunkView) and message.HasField("trailer"):
                self.counted(message.ByteSize())
                self.trailer = message.trailer
                continue
            chunk, size, is_mean = result_chunk(message)  # a ChunkView, unless protobuf parsed it
            self.counted(size)
            if is_mean:
                self.mean.append(chunk)
            else:
                yield chunk

    def complete(self, header: pb.ResultHeader) -> None:
        """Once iterated: a header without a checksum takes its checksum, run_finished and ranges_checksum from the
        trailer (ResultStreamError when there is none)."""
        if not header.checksum:
            if self.trailer is None or not self.trailer.checksum:
                raise ResultStreamError("result stream without a checksum (in its header or a trailer)")
            header.checksum, header.run_finished = self.trailer.checksum, self.trailer.run_finished
            header.ranges_checksum = self.trailer.ranges_checksum


def chunk_deserializer(message_type, chunk_fields: tuple[int, ...]) -> Callable[[bytes], object]:
    """A gRPC deserializer: chunk messages as ChunkViews, every other message as message_type."""

    def parse(raw: bytes):
        view = parse_chunk_message(raw, chunk_fields)
        return view if view is not None else message_type.FromString(raw)

    return parse


def stub_for(channel: grpc.Channel) -> pb_grpc.CoordinatorStub:
    """The generated stub, except that results arrive as ChunkViews and a push's messages go framed by hand
    (diloco/wire/frames.py): neither side copies a payload through protobuf objects."""
    stub = pb_grpc.CoordinatorStub(channel)
    for method, request in (("FetchParameters", pb.FetchRequest), ("PullRoundResult", pb.PullRequest)):
        setattr(stub, method, channel.unary_stream(f"/diloco.v1.Coordinator/{method}", request.SerializeToString,
                                                   chunk_deserializer(pb.ResultMessage, (2, 3))))
    stub.PushPseudoGradient = channel.stream_unary("/diloco.v1.Coordinator/PushPseudoGradient", serialized, pb.PushResponse.FromString)
    return stub
