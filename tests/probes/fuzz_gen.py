"""What tests/probes/fuzz.py sends: random and mutated requests, push streams, raw bytes and call metadata.

Everything comes from one random.Random per fuzzing thread (seeded from the run's seed) and is
generic over the .proto's descriptors, so a field or RPC added to protos/diloco/v1/diloco.proto is
fuzzed without touching this file. A push stream never carries a chunk of the reserved parameter
(`safe_push`), so the fuzzer's contribution can never be complete and folded into the aggregate.
"""

from __future__ import annotations

import random
import struct
import threading
from dataclasses import dataclass, field

import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import DecodeError, Message

from diloco.wire.codec import Fp32Codec
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import PROTOCOL_VERSION, Manifest, payload_digest, push_messages, tensor_chunks

INT64 = (-(2**63), 2**63 - 1)
INTS = [0, 1, -1, 2, 7, 1023, 1024, 4096, 2**31, 2**32, -(2**31), 10**9, *INT64]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.001, 1e-300, 5e-324, 1e308, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", " ", "fp32", "int8", "topk", "e3m0", "bf16", "x" * 257, "île-ü-🙂", "\u202e\x00", "../../etc/passwd",
           "island-", "island-999", "owner:east", "observer", "0" * 64]
RESERVED_KEYS = ["diloco-refusal-bin", "grpc-timeout", "content-type", "te", "user-agent", "authorization",
                 "x-island-id", "grpc-status", "grpc-message"]


@dataclass
class Target:
    """What the fuzzer knows of the run, shared by its threads: the coordinator's manifest, its own island."""

    manifest: Manifest
    reserved: str  # the one parameter the fuzzer never pushes a chunk of
    legit: list[str]  # the islands of the legitimate run (other credentials)
    own: str = ""
    round: int = 0
    chunk_bytes: int = 4096
    digest: str = ""
    tokens: int = 0  # an honest claim: one rank, a full round
    steps: int = 1
    checksum: str = ""  # of the current global parameters (fuzz_client's sync): what a valid push was trained from
    pushed: list[tuple[int, str, int, int]] = field(default_factory=list)  # (round, name, offset, numel) accepted
    lock: threading.Lock = field(default_factory=threading.Lock)

    def remember(self, round_: int, chunks: list[pb.TensorChunk]) -> None:
        with self.lock:
            self.pushed = [p for p in self.pushed if p[0] >= round_][-64:]
            self.pushed += [(round_, c.name, c.offset, c.numel) for c in chunks]


def message_class(descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)


def parses(data: bytes, cls: type[Message]) -> Message | None:
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return None


def safe_push(messages: list[bytes], reserved: str) -> list[bytes]:
    """The stream without any message that parses to a chunk of the reserved parameter: what the server
    parses (with the same parser) can then never cover the whole model, so no contribution completes."""
    out = []
    for data in messages:
        m = parses(data, pb.PushMessage)
        if m is None or m.WhichOneof("kind") != "chunk" or m.chunk.name != reserved:
            out.append(data)
    return out


class Gen:
    """Values, messages, push streams, bytes and metadata, all drawn from one Random; the run is in Target."""

    def __init__(self, rng: random.Random, target: Target):
        self.rng, self.t = rng, target

    # --- values ------------------------------------------------------------------------

    def island_id(self) -> str:
        r, t = self.rng, self.t
        return r.choice([t.own, t.own, t.own, *t.legit, "", r.choice(STRINGS), f"island-{r.randint(0, 9)}"])

    def name(self) -> str:
        names = list(self.t.manifest.shapes)
        return self.rng.choice(names + ["", self.rng.choice(STRINGS), names[0] + "x"])

    def string(self, field_name: str = "") -> str:
        r = self.rng
        if field_name == "island_id" and r.random() < 0.7:
            return self.island_id()
        if field_name == "name" and r.random() < 0.7:
            return self.name()
        if field_name.endswith("checksum") and r.random() < 0.3:
            return "%064x" % r.getrandbits(256)
        if field_name == "config_digest" and r.random() < 0.5:
            return self.t.digest
        roll = r.random()
        if roll < 0.05:  # over gRPC's 16 KiB metadata limit if echoed in a status message; over the receive limit
            return "z" * r.choice([20_000, 20_000, 20_000, 70_000, 200_000])
        if roll < 0.4:
            return r.choice(STRINGS)
        return "".join(chr(r.choice([r.randint(32, 126), r.randint(0x80, 0x2FFF), r.randint(0x1F300, 0x1F64F)]))
                       for _ in range(r.randint(0, 24)))

    def integer(self, field_name: str = "", unsigned: bool = False) -> int:
        r, t = self.rng, self.t
        hints = {"round": [t.round, t.round - 1, t.round + 1], "from_round": [t.round, 0, 10**6],
                 "protocol_version": [PROTOCOL_VERSION, PROTOCOL_VERSION - 1], "fragment": [0, 1, -1],
                 "tokens": [t.tokens, t.tokens * 2, t.tokens + 1], "inner_steps": [t.steps, t.steps + 1],
                 "numel": [1, 32, 1024, 2048], "offset": [0, 1, 1024, 2047], "ranks": [0, 1, 4096, 4097],
                 "first_step": [t.round * t.steps], "index": [0, 1], "samples": [0, 1, 8]}
        if unsigned:
            return r.choice([0, 1, 2**32 - 1, r.getrandbits(32)])
        if field_name in hints and r.random() < 0.5:
            return r.choice(hints[field_name])
        return r.choice([*INTS, r.randint(-1000, 1000), r.randint(*INT64)])

    def floating(self, field_name: str = "") -> float:
        r = self.rng
        if field_name == "timeout_s" and r.random() < 0.6:
            return r.choice([0.0, 0.05, 0.2, -1.0, float("nan"), float("inf"), 1e300])
        return r.choice([*FLOATS, r.uniform(-10, 10)])

    def raw(self, n_max: int = 64) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, n_max))

    def scalar(self, f):
        if f.type == F.TYPE_STRING:
            return self.string(f.name)
        if f.type == F.TYPE_BYTES:
            return self.raw(self.rng.choice([16, 16, 4096, 80_000]))
        if f.type == F.TYPE_DOUBLE:
            return self.floating(f.name)
        if f.type == F.TYPE_BOOL:
            return self.rng.random() < 0.5
        if f.type == F.TYPE_ENUM:  # proto3 enums are open: unknown numbers are legal on the wire
            return self.rng.choice([v.number for v in f.enum_type.values] + [self.rng.randint(-3, 99)])
        return self.integer(f.name, unsigned=f.type in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED64))

    # --- messages ----------------------------------------------------------------------

    def set_field(self, msg: Message, f, depth: int = 0) -> None:
        """Gives one field a random value (a repeated one 0-3 random elements; a oneof member picks that branch)."""
        if f.is_repeated:
            values = getattr(msg, f.name)
            del values[:]
            for _ in range(self.rng.randint(0, 3)):
                if f.type == F.TYPE_MESSAGE:
                    values.add().CopyFrom(self.message(message_class(f.message_type), depth + 1))
                else:
                    values.append(self.scalar(f))
        elif f.type == F.TYPE_MESSAGE:
            getattr(msg, f.name).CopyFrom(self.message(message_class(f.message_type), depth + 1))
        else:
            setattr(msg, f.name, self.scalar(f))

    def message(self, cls: type[Message], depth: int = 0) -> Message:
        """A message with random fields set (nested ones too, to a bounded depth) and one branch of each oneof."""
        msg = cls()
        for f in cls.DESCRIPTOR.fields:
            if f.containing_oneof is None and depth < 3 and self.rng.random() < 0.6:
                self.set_field(msg, f, depth)
        for oneof in cls.DESCRIPTOR.oneofs:
            if depth < 3 and self.rng.random() < 0.9:
                self.set_field(msg, self.rng.choice(oneof.fields), depth)
        return msg

    def tweak(self, msg: Message) -> Message:
        fields = msg.DESCRIPTOR.fields
        for _ in range(self.rng.randint(1, 3)):
            self.set_field(msg, self.rng.choice(fields))
        return msg

    def valid(self, rpc: str) -> Message | None:
        """A request as an honest island of this credential would send it (None: no such RPC known here)."""
        r, t = self.rng, self.t
        pushed = [pb.TensorRange(name=n, offset=o, numel=k) for rnd, n, o, k in list(t.pushed) if rnd == t.round]
        ranges = r.sample(pushed, min(len(pushed), r.randint(0, 2))) if pushed else []
        if not ranges and r.random() < 0.5:  # a range of no elements counts as held by anyone
            ranges = [pb.TensorRange(name=self.name(), offset=0, numel=0)]
        return {
            "Join": lambda: pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname="fuzzer", codec="fp32",
                                           config_digest=t.digest, ranks=1),
            "Heartbeat": lambda: pb.HeartbeatRequest(island_id=t.own, round=t.round),
            "FetchParameters": lambda: pb.FetchRequest(island_id=t.own, ranges=ranges if r.random() < 0.5 else []),
            "PullRoundResult": lambda: pb.PullRequest(island_id=t.own, round=t.round, timeout_s=r.choice([0.05, 0.2, 1.0]),
                                                      accept_delta=r.random() < 0.5, ranges=ranges, want_mean=r.random() < 0.3),
            # Rarely its own island: each leave costs a rejoin, and joins are rate-limited per credential.
            "Leave": lambda: pb.LeaveRequest(island_id=t.own if r.random() < 0.05 else r.choice([*t.legit, "", "island-9"]),
                                             checksum=self.string("checksum"), round=t.round),
            "Lease": lambda: pb.LeaseRequest(island_id=t.own, index=r.randint(0, 3), samples=r.randint(1, 64)),
            "WatchRounds": lambda: pb.WatchRequest(from_round=t.round),
        }.get(rpc, lambda: None)()

    def request(self, rpc: str, cls: type[Message]) -> tuple[bytes, str]:
        """One request's bytes and how they were made: random, a mutated valid one, and maybe byte-mutated."""
        roll, base = self.rng.random(), self.valid(rpc)
        if base is None or roll < 0.3:
            msg, kind = self.message(cls), "random"
        elif roll < 0.45:
            msg, kind = base, "valid"
        else:
            msg, kind = self.tweak(base), "mutated"
        data = msg.SerializeToString()
        if self.rng.random() < 0.25:
            return self.mutate_bytes(data), kind + "+bytes"
        return data, kind

    # --- push streams --------------------------------------------------------------------

    def header(self) -> pb.PushHeader:
        t = self.t
        return pb.PushHeader(island_id=t.own, round=t.round, tokens=t.tokens, train_loss=3.0, codec="fp32",
                             inner_steps=t.steps, first_step=t.round * t.steps, global_checksum=t.checksum)

    def chunks(self) -> list[pb.TensorChunk]:
        """Honest chunks of a few parameters (never the reserved one), maybe only some of their chunks."""
        names = [n for n in self.t.manifest.shapes if n != self.t.reserved]
        g = torch.Generator().manual_seed(self.rng.getrandbits(62))
        pick = {n: torch.randn(self.t.manifest.shapes[n], generator=g) * 1e-3 for n in self.rng.sample(names, self.rng.randint(1, 3))}
        chunks = list(tensor_chunks(pick, Fp32Codec(), self.t.chunk_bytes))
        lo = self.rng.randint(0, len(chunks) - 1)
        return chunks[lo:] if self.rng.random() < 0.5 else chunks

    def push(self) -> tuple[list[bytes], str]:
        """A push stream: random messages, or a valid stream with 0-3 mutations; maybe byte-mutated; made safe."""
        if self.rng.random() < 0.15:
            msgs, kind = [self.message(pb.PushMessage) for _ in range(self.rng.randint(0, 6))], "random"
        else:
            msgs = list(push_messages(self.header(), self.chunks()))
            ops = [self.rng.choice(STREAM_OPS) for _ in range(self.rng.choice([0, 1, 1, 2, 3]))]
            for op in ops:
                msgs = op(self, msgs)
            kind = "+".join(op.__name__ for op in ops) or "valid"
        data = [m.SerializeToString() for m in msgs]
        if data and self.rng.random() < 0.15:
            i = self.rng.randrange(len(data))
            data[i] = self.mutate_bytes(data[i])
            kind += "+bytes"
        return safe_push(data, self.t.reserved), kind

    def pick_chunk(self, msgs: list[pb.PushMessage]) -> pb.TensorChunk | None:
        chunks = [m.chunk for m in msgs if m.WhichOneof("kind") == "chunk"]
        return self.rng.choice(chunks) if chunks else None

    # --- bytes and metadata ----------------------------------------------------------------

    def mutate_bytes(self, data: bytes) -> bytes:
        r, b = self.rng, bytearray(data)
        op = r.randrange(6)
        if op == 0 and b:  # flip 1-4 bits
            for _ in range(r.randint(1, 4)):
                b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        elif op == 1:  # truncate
            del b[r.randint(0, len(b)):]
        elif op == 2:  # insert random bytes
            i = r.randint(0, len(b))
            b[i:i] = r.randbytes(r.randint(1, 8))
        elif op == 3:  # an unknown or mistyped field
            b += bytes([r.randint(1, 255)]) + struct.pack("<Q", r.getrandbits(64))
        elif op == 4:  # a length prefix that lies
            b += bytes([0x0A, 0xFF, 0xFF, 0xFF, 0x7F]) + r.randbytes(4)
        else:  # the message twice: protobuf merges it
            b.extend(bytes(b))
        return bytes(b)

    def metadata(self) -> list[tuple[str, str | bytes]] | None:
        """Extra call metadata, now and then: keys of gRPC's and ours (the refusal's), and now and then one
        gRPC refuses to send (an invalid key or value, or one over its size limit)."""
        r = self.rng
        if r.random() > 0.12:
            return None
        out: list[tuple[str, str | bytes]] = []
        for _ in range(r.randint(1, 3)):
            bad = r.random() < 0.1
            key = r.choice(["Upper", "", "bad key", ":path"] if bad else
                           [*RESERVED_KEYS, "x-" + "".join(r.choice("abc-_.09") for _ in range(r.randint(1, 12))), "x-fuzz-bin"])
            if key.endswith("-bin"):
                value: str | bytes = r.choice([pb.Refusal(reason=r.randint(0, 30)).SerializeToString(), self.raw(), b""])
            else:
                value = r.choice(["é\n", "x\x00y", "v" * 20_000] if bad else ["", "1S", "fp32", "1", "v" * 100])
            out.append((key, value))
        return out

    def deadline(self, normal_s: float) -> tuple[float, bool]:
        """The call's timeout and whether it is a fuzzed short one (its DEADLINE_EXCEEDED is the client's)."""
        if self.rng.random() < 0.08:
            return self.rng.choice([1e-4, 1e-3, 0.01, 0.05, -1.0]), True
        return normal_s, False


# --- push stream mutations: each takes and returns the list of messages ------------------------------

def flip_payload(g: Gen, msgs):
    if (c := g.pick_chunk(msgs)) is not None and c.payload:
        p = bytearray(c.payload)
        p[g.rng.randrange(len(p))] ^= 1 << g.rng.randrange(8)
        c.payload = bytes(p)
        if g.rng.random() < 0.5:  # and fix its CRC: the payload is then well formed, only its values changed
            c.xxh3 = payload_digest(c.payload)
    return msgs


def nan_payload(g: Gen, msgs):
    if (c := g.pick_chunk(msgs)) is not None and c.payload:
        i = 4 * g.rng.randrange(len(c.payload) // 4)
        c.payload = c.payload[:i] + struct.pack("<f", g.rng.choice(FLOATS[-3:])) + c.payload[i + 4:]
        c.xxh3 = payload_digest(c.payload)
    return msgs


def resize_payload(g: Gen, msgs):
    if (c := g.pick_chunk(msgs)) is not None:
        c.payload = g.rng.choice([c.payload[:-1], c.payload + b"\0", b"", g.raw(3 * g.t.chunk_bytes + 70_000)])
        c.xxh3 = payload_digest(c.payload)
    return msgs


def readdress(g: Gen, msgs):
    if (c := g.pick_chunk(msgs)) is not None:
        what = g.rng.choice(["name", "offset", "numel", "xxh3"])
        setattr(c, what, g.name() if what == "name" else g.integer(what, unsigned=what == "xxh3"))
    return msgs


def tweak_header(g: Gen, msgs):
    for m in msgs:
        if m.WhichOneof("kind") == "header":
            g.tweak(m.header)
    return msgs


def drop_end(g: Gen, msgs):
    return [m for m in msgs if m.WhichOneof("kind") != "end"]


def repeat_end(g: Gen, msgs):
    return msgs + [pb.PushMessage(end=pb.PushEnd(chunks=g.integer(unsigned=True)))]


def miscount_end(g: Gen, msgs):
    for m in msgs:
        if m.WhichOneof("kind") == "end":
            m.end.chunks = g.integer(unsigned=True)
    return msgs


def reorder(g: Gen, msgs):
    g.rng.shuffle(msgs)
    return msgs


def duplicate_chunk(g: Gen, msgs):
    if (c := g.pick_chunk(msgs)) is not None:
        msgs.insert(g.rng.randint(1, len(msgs)), pb.PushMessage(chunk=c))
    return msgs


def truncate(g: Gen, msgs):
    return msgs[: g.rng.randint(0, len(msgs))]


def drop_header(g: Gen, msgs):
    return [m for m in msgs if m.WhichOneof("kind") != "header"]


def repeat_header(g: Gen, msgs):
    return msgs[:1] + [pb.PushMessage(header=g.header())] + msgs[1:] if g.rng.random() < 0.5 else msgs + msgs[:1]


def insert_random(g: Gen, msgs):
    msgs.insert(g.rng.randint(0, len(msgs)), g.message(pb.PushMessage))
    return msgs


STREAM_OPS = [flip_payload, nan_payload, resize_payload, readdress, readdress, tweak_header, tweak_header, drop_end,
              repeat_end, miscount_end, reorder, duplicate_chunk, truncate, drop_header, repeat_header, insert_random]
