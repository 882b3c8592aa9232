"""The one place where tensors become protocol messages and back.

A tensor travels as TensorChunks addressed by (name, flat offset, numel). The
chunk size comes from the codec so that every message stays far below gRPC's
4 MB default limit, whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import xxhash

from diloco.wire.codec import Codec, get_codec
from diloco.config import WireConfig
from diloco.wire.feedback import ErrorFeedback
from diloco.v1 import diloco_pb2 as pb

# 2: top-k followed by zstd sent its positions as a bitmap above density 1/64.
# 3: top-k positions travel Golomb-Rice coded, after all levels and codes.
# 4: every refusal carries a typed Refusal (diloco/wire/refusal.py) in its trailing metadata.
# 7: the limits' refusals (STREAM_IDLE, RATE_LIMITED, SPOOL_FULL), which older islands cannot read.
# 8: late contributions (PushResponse.late, folded_into; IslandContribution.staleness, weight), time-boxed rounds and
#    compression per link (ResultHeader.push_codec; pushes in any of wire.link_codecs).
# 9: chunks carry an XXH3-64 of their payload (TensorChunk.xxh3) instead of a CRC-32.
# 10: a pull served while the round's update is still being made streams it, and a ResultTrailer completes the header.
# 11: a sharded coordinator (shard addresses and tickets at join, Judge, shard proofs).
# 12: a push sends its header, then waits for the coordinator's initial metadata (PUSH_ADMITTED) before its chunks:
#     the coordinator reads at most limits.push_slots pushes at once (coordinator/limits.py PushSlots).
# 13: every call of an island names its process (INSTANCE_KEY metadata): a process that joins as an island another live
#     process is replaces it, whose calls are then refused REPLACED; JoinResponse.replaced.
PROTOCOL_VERSION = 13

# The initial metadata by which the coordinator admits a push to one of its slots.
PUSH_ADMITTED = (("diloco-push", "admitted"),)

# The call metadata naming the island process that makes the call: a token it draws at start, shared by its ranks
# and replica groups (islands/launch.py process_instance). A join with another one replaces the process the island was.
INSTANCE_KEY = "diloco-instance"
INSTANCE_MAX = 64  # characters kept of one (ours are 32)


def instance_from(metadata) -> str:
    """The process an island's call names (INSTANCE_KEY in its invocation metadata); "" when it names none."""
    for key, value in metadata or ():
        if key == INSTANCE_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            return text[:INSTANCE_MAX]
    return ""


class ChunkError(ValueError):
    """A chunk that does not fit the manifest (unknown name, bad range, bad payload)."""


class ChunkCorrupt(ChunkError):
    """A chunk whose payload does not match its checksum."""


@dataclass(frozen=True)
class Manifest:
    """Names and shapes of the parameters in the run, in canonical order."""

    shapes: dict[str, tuple[int, ...]]

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> "Manifest":
        return Manifest({name: tuple(t.shape) for name, t in tensors.items()})

    def numel(self, name: str) -> int:
        n = 1
        for d in self.shapes[name]:
            n *= d
        return n

    def total_numel(self) -> int:
        return sum(self.numel(n) for n in self.shapes)

    def to_proto(self) -> list[pb.ParameterSpec]:
        return [pb.ParameterSpec(name=n, shape=list(s)) for n, s in self.shapes.items()]

    @staticmethod
    def from_proto(specs: Iterable[pb.ParameterSpec]) -> "Manifest":
        return Manifest({s.name: tuple(s.shape) for s in specs})


def _codec_options(wire: WireConfig) -> dict:
    return {
        "zstd": wire.zstd,
        "zstd_level": wire.zstd_level,
        "block_size": wire.block_size,
        "density": wire.topk_density,
        "topk_block": wire.topk_block,
        "topk_bits": wire.topk_bits,
    }


def uplink_codec(wire: WireConfig) -> Codec:
    """The codec islands push pseudo-gradients with."""
    return get_codec(wire.codec, **_codec_options(wire))


def link_codecs(wire: WireConfig) -> dict[str, Codec]:
    """Every codec an island may push with, by its wire name: wire.link_codecs in their order (least lossy first;
    coordinator/links.py advises among them), then the run's codec, which islands start with."""
    codecs = [get_codec(name, **_codec_options(wire)) for name in wire.link_codecs] + [uplink_codec(wire)]
    return {c.name: c for c in codecs}


def downlink_codec(wire: WireConfig) -> Codec:
    """The codec the coordinator sends round updates with."""
    return get_codec(wire.downlink_codec or wire.codec, **_codec_options(wire))


def chunk_spans(numel: int, codec: Codec, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Where a flat tensor of numel elements is cut into chunks: [lo, hi) spans of at most what the codec fits in
    chunk_bytes. Every sender cuts here, so a chunk's bytes never depend on who built it."""
    step = max(1, codec.max_elements(chunk_bytes))
    for lo in range(0, numel, step):
        yield lo, min(lo + step, numel)


def encode_chunks(
    name: str,
    flat: torch.Tensor,
    codec: Codec,
    chunk_bytes: int,
    base_offset: int = 0,
    feedback: ErrorFeedback | None = None,
) -> Iterator[pb.TensorChunk]:
    """Chunks of a flat tensor; offsets count from base_offset (for shards).

    With feedback, each chunk sends the pseudo-gradient plus what earlier rounds
    failed to send, and keeps what this chunk fails to send for later.
    """
    for start, end in chunk_spans(flat.numel(), codec, chunk_bytes):
        piece = flat[start:end]
        if feedback is not None:
            payload = feedback.compress(name, base_offset + start, piece, codec)
        else:
            payload = codec.encode(piece)
        yield make_chunk(name, base_offset + start, piece.numel(), payload)


def payload_digest(payload: bytes | memoryview) -> int:
    """What a chunk carries to prove its payload arrived intact: XXH3-64 (48 GB/s on one core here; CRC-32: 6.9, benchmarks/codecs.py)."""
    return xxhash.xxh3_64_intdigest(payload)


def make_chunk(name: str, offset: int, numel: int, payload: bytes) -> pb.TensorChunk:
    return pb.TensorChunk(name=name, offset=offset, numel=numel, payload=payload, xxh3=payload_digest(payload))


def tensor_chunks(
    tensors: Mapping[str, torch.Tensor], codec: Codec, chunk_bytes: int, feedback: ErrorFeedback | None = None
) -> Iterator[pb.TensorChunk]:
    for name, t in tensors.items():
        yield from encode_chunks(name, t.detach().reshape(-1), codec, chunk_bytes, feedback=feedback)


def push_messages(header: pb.PushHeader, chunks: Iterable[pb.TensorChunk]) -> Iterator[pb.PushMessage]:
    """A push stream: the header, the chunks, and the PushEnd that tells the coordinator it is whole."""
    yield pb.PushMessage(header=header)
    n = 0
    for chunk in chunks:
        n += 1
        yield pb.PushMessage(chunk=chunk)
    yield pb.PushMessage(end=pb.PushEnd(chunks=n))


def _varint_size(n: int) -> int:
    return 10 if n < 0 else max(1, (n.bit_length() + 6) // 7)


def framed_size(chunk: pb.TensorChunk, payload_len: int | None = None) -> int:
    """Bytes on the wire of a message holding only this chunk (PushMessage.chunk, ResultMessage.chunk
    or .mean_chunk: field numbers below 16): a one-byte tag, the varint length, the chunk.

    The same number as the wrapper's ByteSize(), counted from the fields (upb's ByteSize
    serializes the payload to size it: a pass over every chunk of every round, on both
    sides); pass payload_len when the caller holds the payload (reading it copies it).
    """
    name = len(chunk.name.encode())
    size = payload_len if payload_len is not None else len(chunk.payload)
    n = (1 + _varint_size(name) + name if name else 0) + (1 + _varint_size(size) + size if size else 0)
    n += sum(1 + _varint_size(v) for v in (chunk.offset, chunk.numel) if v) + (9 if chunk.xxh3 else 0)
    return 1 + _varint_size(n) + n


def check_chunk(chunk: pb.TensorChunk, manifest: Manifest) -> None:
    """Raises ChunkError naming what is wrong with the chunk's address."""
    if chunk.name not in manifest.shapes:
        raise ChunkError(f"unknown parameter name {chunk.name!r}")
    numel = manifest.numel(chunk.name)
    if chunk.numel <= 0 or chunk.offset < 0:
        raise ChunkError(f"{chunk.name}: bad range offset={chunk.offset} numel={chunk.numel}")
    if chunk.offset + chunk.numel > numel:
        raise ChunkError(
            f"{chunk.name}: elements [{chunk.offset}, {chunk.offset + chunk.numel}) run past the end "
            f"of the tensor ({numel} elements, shape {list(manifest.shapes[chunk.name])})"
        )


def _checked_payload(chunk: pb.TensorChunk, manifest: Manifest, payload: bytes | None = None) -> bytes:
    check_chunk(chunk, manifest)
    payload = chunk.payload if payload is None else payload
    if payload_digest(payload) != chunk.xxh3:
        raise ChunkCorrupt(f"{chunk.name}@{chunk.offset}: payload checksum mismatch")
    return payload


def verify_chunk(chunk: pb.TensorChunk, manifest: Manifest, codec: Codec, payload: bytes | None = None,
                 sumsq: bool = False) -> float:
    """Checks address, checksum and payload size as decode_chunk does; returns the values' sum of squares (fp64)
    with sumsq, else 0.0, and inf or NaN when a value is not finite.

    What the coordinator does with a push as it arrives: the values are decoded
    once, when the round closes, not twice. Pass the payload when the caller
    holds it already (reading chunk.payload copies it).
    """
    payload = _checked_payload(chunk, manifest, payload)
    try:
        if sumsq:
            return codec.sumsq(payload, chunk.numel)
        return 0.0 if codec.finite(payload, chunk.numel) else math.inf
    except ValueError as e:
        raise ChunkError(f"{chunk.name}@{chunk.offset}: {e}") from e


def verify_and_decode(chunk: pb.TensorChunk, manifest: Manifest, codec: Codec,
                      payload: bytes | None = None, out: torch.Tensor | None = None) -> tuple[float, torch.Tensor]:
    """verify_chunk with sumsq, keeping the decoded values (in out, when given): one decode for a caller that reads
    them as they arrive (the coordinator's direction sketch, diloco/robust.py). The sum of squares has codec.sumsq's bits."""
    payload = _checked_payload(chunk, manifest, payload)
    try:
        values, sumsq = codec.decode_sumsq(payload, chunk.numel, out)
    except ValueError as e:
        raise ChunkError(f"{chunk.name}@{chunk.offset}: {e}") from e
    return sumsq, values


def decode_chunk(chunk: pb.TensorChunk, manifest: Manifest, codec: Codec, out: torch.Tensor | None = None,
                 add: bool = False) -> torch.Tensor:
    """Checks address and checksum, then decodes to a flat fp32 tensor (into out, when given; added to it, with add:
    the same bits as out.add_(decoded))."""
    payload = _checked_payload(chunk, manifest)
    try:
        if out is None:
            return codec.decode(payload, chunk.numel)
        if add:
            codec.decode_add(payload, out)
        else:
            codec.decode_into(payload, out)
        return out
    except ValueError as e:
        raise ChunkError(f"{chunk.name}@{chunk.offset}: {e}") from e


def apply_chunks(
    chunks: Iterable[pb.TensorChunk],
    targets: Mapping[str, torch.Tensor],
    manifest: Manifest,
    codec: Codec,
    add: bool = False,
    bases: Mapping[str, int] | None = None,
) -> int:
    """Writes (or, with add, adds) decoded chunks into the flat ranges of targets; returns elements.

    With bases, targets[name] holds only the flat elements [bases[name],
    bases[name] + numel) of the parameter (a shard): each chunk is decoded
    whole and only its overlap with the shard is applied.
    """
    written = 0
    for chunk in chunks:
        flat = targets[chunk.name].view(-1)
        if bases is None:  # a whole chunk: decoded straight into its range, or added there with no decoded copy
            decode_chunk(chunk, manifest, codec, out=flat[chunk.offset : chunk.offset + chunk.numel], add=add)
            written += chunk.numel
            continue
        values = decode_chunk(chunk, manifest, codec)
        lo, hi = chunk.offset, chunk.offset + chunk.numel
        if bases is not None:
            base = bases[chunk.name]
            lo, hi = max(lo, base), min(hi, base + flat.numel())
            if lo >= hi:
                continue
            values = values[lo - chunk.offset : hi - chunk.offset]
            lo, hi = lo - base, hi - base
        target = flat[lo:hi]
        # add_ on fp32 is the coordinator's exact operation, so both copies stay bit-identical.
        target.add_(values) if add else target.copy_(values)
        written += hi - lo
    return written


@dataclass(frozen=True)
class FlatRange:
    """Elements [offset, offset + numel) of parameter `name`, flattened: one rank's shard of it."""

    name: str
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


def ranges_to_proto(ranges: Iterable[FlatRange]) -> list[pb.TensorRange]:
    return [pb.TensorRange(name=r.name, offset=r.offset, numel=r.numel) for r in ranges]


def ranges_from_proto(ranges: Iterable[pb.TensorRange], manifest: Manifest) -> list[FlatRange]:
    """Checked ranges of a request; raises ChunkError naming the bad one."""
    out = []
    for r in ranges:
        if r.name not in manifest.shapes:
            raise ChunkError(f"unknown parameter name {r.name!r} in requested ranges")
        if r.offset < 0 or r.numel < 0 or r.offset + r.numel > manifest.numel(r.name):
            raise ChunkError(
                f"{r.name}: requested elements [{r.offset}, {r.offset + r.numel}) are outside the tensor "
                f"({manifest.numel(r.name)} elements)"
            )
        out.append(FlatRange(r.name, r.offset, r.numel))
    return out


def overlapping_chunks(chunks: Iterable[pb.TensorChunk], ranges: Iterable[FlatRange]) -> Iterator[pb.TensorChunk]:
    """The chunks that touch any of the ranges (a lossy chunk cannot be cut, so whole chunks go)."""
    by_name: dict[str, list[FlatRange]] = {}
    for r in ranges:
        by_name.setdefault(r.name, []).append(r)
    for chunk in chunks:
        end = chunk.offset + chunk.numel
        if any(r.offset < end and chunk.offset < r.end for r in by_name.get(chunk.name, ())):
            yield chunk


class Coverage:
    """Tracks which flat ranges of each parameter have arrived, to prove exactly-once."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def copy(self) -> "Coverage":
        other = Coverage(self.manifest)
        other.ranges = {n: list(r) for n, r in self.ranges.items()}
        return other

    def add(self, name: str, offset: int, numel: int) -> None:
        self.ranges.setdefault(name, []).append((offset, offset + numel))

    def covers(self, ranges: Iterable["FlatRange"] | None = None) -> bool:
        """Whether every element of these flat ranges (of every parameter, when None) has arrived."""
        wanted = ranges if ranges is not None else [FlatRange(n, 0, self.manifest.numel(n)) for n in self.manifest.shapes]
        for r in wanted:
            end = r.offset
            for lo, hi in sorted(self.ranges.get(r.name, [])):
                if lo <= end < hi:
                    end = hi
            if r.numel and end < r.end:
                return False
        return True

    def overlaps(self) -> bool:
        """Whether some element arrived more than once."""
        for spans in self.ranges.values():
            end = 0
            for lo, hi in sorted(spans):
                if lo < end:
                    return True
                end = max(end, hi)
        return False

    def problem(self) -> str | None:
        """None when every element of every parameter arrived exactly once, else what is off."""
        for name in self.manifest.shapes:
            spans = sorted(self.ranges.get(name, []))
            end = 0
            for lo, hi in spans:
                if lo < end:
                    return f"{name}: elements [{lo}, {min(hi, end)}) arrived more than once"
                if lo > end:
                    return f"{name}: elements [{end}, {lo}) are missing"
                end = hi
            if end != self.manifest.numel(name):
                return f"{name}: elements [{end}, {self.manifest.numel(name)}) are missing"
        return None
