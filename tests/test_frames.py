"""Chunk messages framed by hand (diloco/wire/frames.py) against protobuf's own serializing and parsing."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from google.protobuf.message import DecodeError

from diloco.wire.codec import get_codec
from diloco.wire.frames import ChunkView, chunk_of, fp32_payload, frame_chunk, parse_chunk_message, push_frames, serialized_values
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import make_chunk, push_messages, tensor_chunks

pytestmark = pytest.mark.unit


def test_serialized_values_are_the_messages_bytes():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3), "w" * 200: torch.randn(70, 300), "b": torch.randn(0), "c.weight": torch.randn(5000)}
    for chunk_bytes in (4, 1000, 1 << 20):  # one element a chunk; chunks ending inside a tensor; whole tensors
        expected = [pb.ResultMessage(chunk=c).SerializeToString() for c in tensor_chunks(tensors, get_codec("fp32"), chunk_bytes)]
        assert list(serialized_values(tensors, chunk_bytes)) == expected


@pytest.mark.parametrize("seed", range(2))
def test_a_chunk_framed_by_hand_is_the_messages_bytes_whatever_holds_it(seed):
    """Every field at its default or not, negative and ten-byte offsets, names of one and two-byte varint lengths:
    frame_chunk gives SerializeToString()'s bytes for a TensorChunk, for its fields (Chunk), and for the ChunkView
    a received message was read as."""
    rng = random.Random(seed)
    for _ in range(2000):
        chunk = _chunk(rng)
        if rng.random() < 0.1:
            chunk.xxh3 = 0
        plain = chunk_of(chunk.name, chunk.offset, chunk.numel, memoryview(chunk.payload))
        for field, wrapper in ((2, pb.PushMessage(chunk=chunk)), (2, pb.ResultMessage(chunk=chunk)), (3, pb.ResultMessage(mean_chunk=chunk))):
            expected = wrapper.SerializeToString()
            assert frame_chunk(field, chunk) == expected
            if chunk.xxh3 == plain.xxh3:  # the digest chunk_of computes, unless the chunk was given another
                assert frame_chunk(field, plain) == expected
            view = parse_chunk_message(expected, (field,))
            if view is not None:
                assert frame_chunk(field, view) == expected


def test_a_push_framed_by_hand_is_the_push_messages_bytes():
    torch.manual_seed(0)
    header = pb.PushHeader(island_id="island-1", round=7, tokens=4096, codec="int8", global_checksum="ab" * 16)
    chunks = list(tensor_chunks({"a": torch.randn(3000), "b.weight": torch.randn(40, 50)}, get_codec("int8"), 1000))
    expected = [m.SerializeToString() for m in push_messages(header, chunks)]
    assert len(expected) > 4 and list(push_frames(header, chunks)) == expected
    assert list(push_frames(header, [])) == [m.SerializeToString() for m in push_messages(header, [])]


def _chunk(rng: random.Random) -> pb.TensorChunk:
    name = rng.choice(["", "embed", "blocks.0.attn.w", "é" * 70, "x" * 300])
    payload = rng.randbytes(rng.choice([0, 1, 4, 130, 3000]))
    chunk = make_chunk(name, rng.choice([0, 1, 127, 128, 2**40, -1, -(2**63)]), rng.choice([0, 1, 300, 2**31]), payload)
    if rng.random() < 0.2:
        chunk.xxh3 = rng.choice([0, 1, 2**64 - 1])
    return chunk


def _messages(rng: random.Random) -> bytes:
    chunk = _chunk(rng)
    kind = rng.randrange(6)
    if kind == 0:
        return pb.PushMessage(header=pb.PushHeader(island_id="i", round=3)).SerializeToString()
    if kind == 1:
        return pb.PushMessage(end=pb.PushEnd(chunks=rng.randrange(5))).SerializeToString()
    if kind == 2:
        return pb.ResultMessage(mean_chunk=chunk).SerializeToString()
    raw = pb.PushMessage(chunk=chunk).SerializeToString()
    if kind == 4:  # a field twice, an unknown field, the old CRC-32 field, or a field of the wrong wire type
        extra = rng.choice([b"\x18\x05", b"\x0a\x01a", b"\x38\x01", b"\x28\x07", b"\x12\x01x", b"\x31" + struct.pack("<Q", 9)])
        body = pb.TensorChunk.FromString(raw[len(raw) - chunk.ByteSize():]).SerializeToString() + extra
        raw = b"\x12" + bytes([len(body)]) + body if len(body) < 128 else raw
    return raw


def _damaged(rng: random.Random, raw: bytes) -> bytes:
    data = bytearray(raw)
    for _ in range(rng.randrange(1, 4)):
        what = rng.randrange(4)
        if what == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif what == 1:
            del data[rng.randrange(len(data) + 1):]
        elif what == 2:
            data += rng.randbytes(rng.randrange(1, 4))
        elif data:
            data[rng.randrange(len(data))] = rng.choice([0x80, 0xFF, 0x00, 0x12, 0x1A])
    return bytes(data)


@pytest.mark.parametrize("seed", range(4))
def test_a_chunk_view_reads_as_protobuf_parses_and_anything_else_is_left_to_protobuf(seed):
    rng = random.Random(seed)
    parsed = 0
    for n in range(3000):
        raw = _messages(rng) if n % 2 else _damaged(rng, _messages(rng))
        for wrapper, fields in ((pb.PushMessage, (2,)), (pb.ResultMessage, (2, 3))):
            view = parse_chunk_message(raw, fields)
            try:
                message = wrapper.FromString(raw)
            except DecodeError:
                assert view is None, raw  # protobuf refuses it: so must the view, and protobuf gives the error
                continue
            if view is None:
                continue
            parsed += 1
            assert isinstance(view, ChunkView) and message.WhichOneof("kind") == wrapper.DESCRIPTOR.fields_by_number[view.field].name
            chunk = getattr(message, message.WhichOneof("kind"))
            assert (view.name, view.offset, view.numel, bytes(view.payload), view.xxh3) == \
                (chunk.name, chunk.offset, chunk.numel, chunk.payload, chunk.xxh3), raw
            assert view.size == len(raw)
    assert parsed > 1000  # the views were not all declined


def test_a_chunk_with_a_field_it_does_not_know_or_a_field_twice_is_left_to_protobuf():
    body = make_chunk("w", 4, 1, b"\x00\x00\x80\x3f").SerializeToString()
    assert parse_chunk_message(b"\x12" + bytes([len(body)]) + body, (2,)) is not None
    for extra in (b"\x38\x01", b"\x28\x07", b"\x18\x02", b"\x12\x01x", b"\x1a\x00"):  # unknown, old CRC, twice, wire types
        raw = b"\x12" + bytes([len(body) + len(extra)]) + body + extra
        pb.PushMessage.FromString(raw)  # protobuf takes each of them (keeping or merging fields)
        assert parse_chunk_message(raw, (2,)) is None, extra


def test_only_the_chunk_fields_asked_for_are_views():
    chunk = make_chunk("w", 4, 1, b"\x00\x00\x80\x3f")
    end = pb.PushMessage(end=pb.PushEnd(chunks=3)).SerializeToString()  # field 3 of a push is PushEnd, not a chunk
    assert parse_chunk_message(end, (2,)) is None
    mean = pb.ResultMessage(mean_chunk=chunk).SerializeToString()
    assert parse_chunk_message(mean, (2, 3)).field == 3 and parse_chunk_message(mean, (2,)) is None


def test_an_fp32_payload_framed_from_the_tensors_memory_is_the_fp32_codecs_bytes():
    """islands/round.py pg_chunks frames an fp32 push from the pseudo-gradient's own memory: the same bytes as the
    codec's encoding, for views, strided pieces, other dtypes and empty pieces alike."""
    fp32, base = get_codec("fp32"), torch.randn(64, 33)
    pieces = [base.view(-1)[5:900], base[:, 3], base.to(torch.bfloat16).view(-1)[:100], base.view(-1)[:0], -base.view(-1)]
    for piece in pieces:
        ours, codec = fp32_payload(piece), fp32.encode(piece)
        assert bytes(ours) == codec
        assert frame_chunk(2, chunk_of("w", 7, piece.numel(), ours)) == frame_chunk(2, chunk_of("w", 7, piece.numel(), codec))
    view = fp32_payload(base.view(-1)[10:20])
    assert isinstance(view, memoryview) and view.nbytes == 40  # no copy where none is needed
