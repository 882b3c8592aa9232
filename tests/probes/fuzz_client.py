"""The fuzzer's client (tests/probes/fuzz.py runs it): generic calls that send bytes, and the judge of each answer.

It is made from the .proto alone: every RPC of the Coordinator service, called through a
multicallable with identity serializers, so that what goes out may not even parse; no island code.
Each answer must be explained (`explain`): a typed Refusal whose status is its reason's
(diloco/wire/refusal.py), or gRPC's own answer to input that never reached the servicer. Anything else,
UNKNOWN first of all (an exception in a servicer), is a failure, kept with the request's bytes.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from coordinator.limits import max_message_bytes
from diloco.security import credentials
from diloco.config import RunConfig
from diloco.wire.refusal import STATUS, Reason, refusal_of
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, Manifest
from tests.probes.fuzz_gen import Gen, Target, message_class, parses

SERVICE = pb.DESCRIPTOR.services_by_name["Coordinator"]
TIMEOUT_S = 10.0  # every fuzz call's deadline unless it fuzzes a short one
# They wait for a round by design (a watch streams until the run ends): a short deadline keeps the fuzzing
# threads calling, and their DEADLINE_EXCEEDED is the client's own.
LONG_POLLS = {"PullRoundResult", "WatchRounds"}
LONG_POLL_S = 1.0
# The deepest path gets more of the calls; joins are rate-limited; a watch mostly waits.
WEIGHTS = {"PushPseudoGradient": 4, "Join": 0.5, "WatchRounds": 0.5}
C = grpc.StatusCode
VALID_KEY = re.compile(r"[0-9a-z_.-]+")  # what gRPC accepts as a metadata key


def _raw(data: bytes) -> bytes:
    return data


@dataclass
class Sent:
    """One fuzz call: what went out and how."""

    rpc: str
    data: list[bytes]
    kind: str
    metadata: list | None
    timeout: float
    short: bool  # a fuzzed short deadline: its DEADLINE_EXCEEDED is the client's own
    read: int  # result messages read before cancelling a server stream

    def island_id(self, cls) -> str | None:
        """The island the call acts as (None: it names none, or its bytes do not parse)."""
        first = parses(self.data[0], cls) if self.data else None
        if isinstance(first, pb.PushMessage):
            return first.header.island_id if first.WhichOneof("kind") == "header" else None
        return getattr(first, "island_id", None)


def explain(sent: Sent, cls, code: C | None, refusal: pb.Refusal, cancelled: bool, limit: int) -> str | None:
    """The table's label for an answer, or None when nothing explains it (a failure of the coordinator)."""
    if code == C.OK:
        return "-"
    if refusal.reason and STATUS.get(refusal.reason) == code:  # the coordinator's own refusal, with its reason's status
        return Reason.Name(refusal.reason)
    label = _grpc_answer(sent, cls, code, cancelled, limit)
    # gRPC's answer can overtake a refusal: a push refused while its next message fails to parse ends INTERNAL,
    # with the servicer's refusal in the trailer; a cancelled call's trailer may hold the refusal that was on its way.
    return f"{label} over {Reason.Name(refusal.reason)}" if label and refusal.reason else label


def _grpc_answer(sent: Sent, cls, code: C | None, cancelled: bool, limit: int) -> str | None:
    """gRPC's own answer to what was sent, which never reached the servicer: the reason it is, or None."""
    trouble = metadata_trouble(sent.metadata)
    if code == C.RESOURCE_EXHAUSTED and max(map(len, sent.data), default=0) > limit:
        return "(too large)"
    if code == C.INTERNAL and any(parses(d, cls) is None for d in sent.data):
        return "(unparseable)"
    if code == C.DEADLINE_EXCEEDED and (sent.short or sent.rpc in LONG_POLLS):
        return "(client deadline)"
    if code == C.CANCELLED and cancelled:
        return "(client cancel)"
    if code in (C.INTERNAL, None) and "invalid" in trouble:  # None: the client library refused to send it
        return "(invalid metadata)"
    if code == C.RESOURCE_EXHAUSTED and "large" in trouble:
        return "(metadata too large)"
    return None


def metadata_trouble(metadata: list | None) -> set[str]:
    """What gRPC itself may refuse in call metadata: an invalid key or value, too much of it, a key of its own."""
    trouble = set()
    for key, value in metadata or ():
        if not VALID_KEY.fullmatch(key) or (not key.endswith("-bin") and any(not " " <= ch <= "~" for ch in value)):
            trouble.add("invalid")
        if key.startswith("grpc-"):
            trouble.add("reserved")
    if sum(len(k) + len(v) for k, v in metadata or ()) > 8192:
        trouble.add("large")
    return trouble


class Fuzzer:
    """Fuzzing threads on one channel under the "fuzzer" credential; counts every answer."""

    def __init__(self, address: str, tls: credentials.TlsFiles, cfg: RunConfig, legit: list[str], is_member, seed: int,
                 calls: int, seconds: float, threads: int = 2):
        """legit: the islands of other credentials, which it must never act as; is_member(island): whether one
        is a member of the run now (a check the harness can make and a client cannot)."""
        ca, cert, key = tls.read()
        self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.cfg, self.legit, self.is_member, self.limit = cfg, legit, is_member, max_message_bytes(cfg)
        self.methods = {m.name: (m, self._multicallable(m)) for m in SERVICE.methods}
        self.rng = random.Random(seed)  # the one seed everything comes from: each thread's Random is drawn from it
        self.budget, self.seconds, self.n_threads = calls, seconds, threads
        self.tally: Counter[tuple[str, str, str]] = Counter()
        self.failures: list[str] = []
        self.count, self.lock = 0, threading.Lock()
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()  # set when the run it disturbs has ended: fuzzing stops there too
        self.t: Target | None = None

    def _multicallable(self, m):
        path = f"/{SERVICE.full_name}/{m.name}"
        make = {(False, False): self.channel.unary_unary, (False, True): self.channel.unary_stream,
                (True, False): self.channel.stream_unary, (True, True): self.channel.stream_stream}
        return make[(m.client_streaming, m.server_streaming)](path, request_serializer=_raw, response_deserializer=_raw)

    def join(self) -> None:
        """Joins as the fuzzer's own island: the manifest it fuzzes pushes against, and an island to act as."""
        joined = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname="fuzzer"), timeout=TIMEOUT_S)
        manifest = Manifest.from_proto(joined.parameters)
        inner = self.cfg.inner
        self.t = Target(manifest, list(manifest.shapes)[-1], self.legit, joined.island_id,
                        joined.round, joined.max_chunk_bytes, joined.config_digest,
                        inner.steps_per_round * inner.batch_size * self.cfg.data.seq_len, inner.steps_per_round)
        self.t.checksum = self.checksum()

    def start(self) -> None:
        self.deadline = time.monotonic() + self.seconds
        seeds = [self.rng.getrandbits(64) for _ in range(self.n_threads)]
        self.threads = [threading.Thread(target=self._loop, args=(s,), daemon=True) for s in seeds]
        for thread in self.threads:
            thread.start()

    def wait(self) -> bool:
        """Waits for the threads (each call has a deadline, so they end soon after the budget)."""
        for thread in self.threads:
            thread.join(self.seconds + 20 * TIMEOUT_S)
        return not any(t.is_alive() for t in self.threads)

    def close(self) -> None:
        self.channel.close()

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    # --- the calls --------------------------------------------------------------------

    def _ticket(self) -> bool:
        with self.lock:
            if self.count >= self.budget or time.monotonic() > self.deadline or self.stop.is_set():
                return False
            self.count += 1
            return True

    def _loop(self, seed: int) -> None:
        gen = Gen(random.Random(seed), self.t)
        rpcs = list(self.methods)
        weights = [WEIGHTS.get(r, 1) for r in rpcs]
        n = 0
        while self._ticket():
            rpc = gen.rng.choices(rpcs, weights)[0]
            try:
                self.one(gen, rpc)
            except Exception as e:  # noqa: BLE001 - a fault of the fuzzer itself: reported, and it goes on
                self.fail(f"the fuzzer failed making or reading a {rpc} call: {type(e).__name__}: {e}")
            n += 1
            if n % 20 == 0:
                self.sync()

    def one(self, gen: Gen, rpc: str) -> None:
        m, _ = self.methods[rpc]
        cls = message_class(m.input_type)
        if rpc == "PushPseudoGradient":
            data, kind = gen.push()
        elif m.client_streaming:
            data, kind = [gen.request(rpc, cls)[0] for _ in range(gen.rng.randint(0, 3))], "random"
        else:
            made, kind = gen.request(rpc, cls)
            data = [made]
        timeout, short = gen.deadline(LONG_POLL_S if rpc in LONG_POLLS else TIMEOUT_S)
        read = gen.rng.choice([0, 1, 2, 3] + ([] if rpc in LONG_POLLS else [10_000]))  # 10,000: to its end
        sent = Sent(rpc, data, kind, gen.metadata(), timeout, short, read)
        code, refusal, responses, cancelled, details = self.invoke(sent)
        label = explain(sent, cls, code, refusal, cancelled, self.limit)
        if code == C.OK and not m.server_streaming and responses[0] is None:  # OK, and no message came:
            # what gRPC makes of a call that sends its own grpc-status header as call metadata
            label = "(grpc-* metadata)" if "reserved" in metadata_trouble(sent.metadata) else None
            responses = []
        with self.lock:
            self.tally[(rpc, code.name if code is not None else "LOCAL", label or "UNEXPLAINED")] += 1
        if label is None:
            self.fail(f"{rpc} ({kind}) answered {code} {details[:200]!r}; request {[d[:64].hex() for d in data[:4]]} "
                      f"(first 64 bytes of {[len(d) for d in data]}), metadata {str(sent.metadata)[:200]}")
        self.after(sent, cls, code, refusal, responses)

    def invoke(self, sent: Sent) -> tuple[C | None, pb.Refusal, list[bytes], bool, str]:
        """(status, refusal, responses, whether we cancelled, details) of one call."""
        m, call = self.methods[sent.rpc]
        kw = {"timeout": sent.timeout, "metadata": sent.metadata}
        try:
            if m.client_streaming:
                return C.OK, pb.Refusal(), [call(iter(sent.data), **kw)], False, ""
            if not m.server_streaming:
                return C.OK, pb.Refusal(), [call(sent.data[0], **kw)], False, ""
            stream, out = call(sent.data[0], **kw), []
            for message in stream if sent.read else ():
                out.append(message)
                if len(out) >= sent.read:
                    break
            else:
                if sent.read:  # read to its end
                    return C.OK, pb.Refusal(), out, False, ""
            stream.cancel()  # a bounded read: we hang up (the answer may have been complete already)
            return stream.code(), refusal_of(stream), out, True, stream.details() or ""
        except grpc.RpcError as e:
            return e.code(), refusal_of(e), [], False, e.details() or ""
        except (TypeError, ValueError) as e:  # refused by the client library itself (bad metadata)
            return None, pb.Refusal(), [], False, f"{type(e).__name__}: {e}"

    def after(self, sent: Sent, cls, code: C | None, refusal: pb.Refusal, responses: list[bytes]) -> None:
        """What the answer tells: the fuzzer's island and round, what it pushed; and what must never happen."""
        t, island = self.t, sent.island_id(cls)
        if island in t.legit and code == C.OK and self.is_member(island):
            self.fail(f"{sent.rpc} acting as {island}, a member under another credential, succeeded")
        if code == C.OK and sent.rpc == "Join" and responses:
            joined = pb.JoinResponse.FromString(responses[0])
            t.own, t.round = joined.island_id, joined.round
        elif code == C.OK and sent.rpc == "PushPseudoGradient" and responses:
            if pb.PushResponse.FromString(responses[0]).contribution_complete:
                self.fail(f"a fuzz push ({sent.kind}) completed a contribution; its first message {sent.data[0][:64].hex()}")
            messages = [pb.PushMessage.FromString(d) for d in sent.data]
            t.remember(messages[0].header.round, [m.chunk for m in messages if m.WhichOneof("kind") == "chunk"])
        elif refusal.reason == Reason.ROUND_CLOSED:
            t.round = refusal.current_round
        gone = (code == C.OK and sent.rpc == "Leave") or refusal.reason == Reason.NOT_A_MEMBER
        if gone and island == t.own:
            self.rejoin()

    def sync(self) -> None:
        """A plain heartbeat: keeps the fuzzer's lease, learns the round (and the parameters' checksum), rejoins when it
        was evicted."""
        try:
            t = self.t
            t.round = self.stub.Heartbeat(pb.HeartbeatRequest(island_id=t.own, round=t.round), timeout=TIMEOUT_S).round
            t.checksum = self.checksum()
        except grpc.RpcError as e:
            if refusal_of(e).reason == Reason.NOT_A_MEMBER:
                self.rejoin()
            elif not refusal_of(e).reason:
                self.fail(f"a plain heartbeat failed: {e.code()} {e.details()!r}")

    def checksum(self) -> str:
        """The checksum of the current global parameters, from a fetch's header: the one a valid push names."""
        results = self.stub.FetchParameters(pb.FetchRequest(island_id=self.t.own), timeout=TIMEOUT_S)
        try:
            return next(iter(results)).header.checksum
        finally:
            results.cancel()

    def rejoin(self) -> None:
        try:
            joined = self.stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, hostname="fuzzer"), timeout=TIMEOUT_S)
            self.t.own, self.t.round = joined.island_id, joined.round
        except grpc.RpcError as e:  # a typed refusal (the run finished, probation) leaves the old id: calls go on
            if not refusal_of(e).reason:
                self.fail(f"a plain join failed: {e.code()} {e.details()!r}")
