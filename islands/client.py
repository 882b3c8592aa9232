"""An island's connection to the coordinator: join, heartbeat, fetch, push, pull, leave."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import torch

from diloco.wire.codec import Codec, get_codec
from diloco.security.credentials import TlsFiles
from diloco.wire.frames import ChunkView, ResultRest, ResultStreamError, push_frames, stub_for
from diloco.params import checksum, ranges_checksum
from diloco.progress import WORTH_SHOWING, Progress, human_bytes
from diloco.wire.refusal import Reason, is_transport_failure, refusal_of, status_of
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import (
    INSTANCE_KEY,
    PROTOCOL_VERSION,
    FlatRange,
    Manifest,
    apply_chunks,
    framed_size,
    ranges_to_proto,
)
from islands.handshake import CoordinatorUnreachable, await_coordinator

log = logging.getLogger(__name__)

# Broken streams found on our side that a fetch (values overwrite) may simply try again.
_LOCAL_RETRYABLE = {Reason.BAD_CHUNK, Reason.CHECKSUM_MISMATCH}

# Told of every push, pull and fetch call as it ends: (kind, fragment, round, seconds, bytes, ok).
CallObserver = Callable[[str, int, int, float, int, bool], None]


class MeanBuffer:
    """Where a pull puts the round's mean pseudo-gradient (eager updates); complete once all of it came.

    With ranges, tensors are flat shards holding just those ranges (a rank of a sharded island)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], manifest: Manifest, codec: Codec,
                 ranges: list[FlatRange] | None = None):
        self.tensors, self.manifest, self.codec, self.ranges = tensors, manifest, codec, ranges
        self.complete = False

    def take(self, chunks: list[pb.TensorChunk]) -> None:
        bases = {r.name: r.offset for r in self.ranges} if self.ranges is not None else None
        expected = sum(r.numel for r in self.ranges) if self.ranges is not None else self.manifest.total_numel()
        self.complete = bool(chunks) and apply_chunks(chunks, self.tensors, self.manifest, self.codec, bases=bases) == expected


class ReplayableChunks:
    """Encoded chunks produced lazily, kept so a push can be resent without re-encoding.

    Re-encoding would be wrong, not just slow: with error feedback, encoding
    consumes the residual.
    """

    def __init__(self, source: Iterable[pb.TensorChunk]):
        self._source = iter(source)
        self._cache: list[pb.TensorChunk] = []

    def iter_from(self, start: int) -> Iterator[pb.TensorChunk]:
        i = start
        while True:
            if i >= len(self._cache):
                chunk = next(self._source, None)
                if chunk is None:
                    return
                self._cache.append(chunk)
            yield self._cache[i]
            i += 1


class RegeneratingChunks:
    """Chunks produced afresh for every (re)send from a pure function of the chunk index.

    For a rank pushing its shard: nothing is kept between sends, so the push
    holds one chunk at a time instead of an encoded copy of the shard. The
    factory must give the same chunks every time (it may not consume state).
    factory(start, keep): the chunks from index start of the parameters in keep (None: all of them).
    """

    def __init__(self, factory: Callable[[int, Collection[str] | None], Iterator[pb.TensorChunk]],
                 names: Collection[str] | None = None, keep: Collection[str] | None = None):
        self._factory, self._keep = factory, keep
        self.names = names  # the parameters the chunks cover, where known

    def iter_from(self, start: int) -> Iterator[pb.TensorChunk]:
        return self._factory(start, self._keep)

    def only(self, names: Collection[str]) -> RegeneratingChunks:
        """The chunks of these parameters (a coordinator shard's, islands/sharded.py), made without the others'."""
        keep = set(names) if self._keep is None else set(names) & set(self._keep)
        covered = None if self.names is None else keep & set(self.names)
        return RegeneratingChunks(self._factory, covered, keep)


def channel_options(receive_window_bytes: int = 0) -> list[tuple[str, int]]:
    """gRPC options for an island's connection.

    receive_window_bytes > 0 fixes each stream's HTTP/2 receive window instead
    of letting gRPC grow it by probing the bandwidth-delay product. The window
    bounds what the transport buffers while the island applies a result chunk
    by chunk; a slow (CPU-starved) receiver otherwise lets it grow to the
    size of the whole stream. Throughput per stream is about window / RTT, so
    size it near bandwidth x RTT.

    Reconnecting is tried at least every RECONNECT_MAX_S: gRPC's own backoff grows to 120 s, so after a coordinator
    restart of half a minute an island kept failing on a server up again for seconds, until its lease there ran out.
    """
    reconnect = [("grpc.initial_reconnect_backoff_ms", 1000), ("grpc.max_reconnect_backoff_ms", int(RECONNECT_MAX_S * 1000))]
    if receive_window_bytes <= 0:
        return reconnect
    return reconnect + [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]


RECONNECT_MAX_S = 2.0  # a connection to a coordinator that went away is tried again at least this often


SLOT_NOTICE_S = 10.0  # a push that waits this long for a slot says so
WAIT_NOTICE_S = 1.0  # a wait says what it waits for once it lasts this long (a pull usually takes milliseconds)...
STILL_EVERY_S = 10.0  # ...and that it still waits this often


@dataclass
class Wait:
    """One wait a user meets, which may span several calls (a pull asked again until its round closes)."""
    what: str
    started: float = field(default_factory=time.monotonic)
    last_told: float | None = None  # when it was last told (None: not yet)


@contextmanager
def told_wait(wait: Wait, enabled: bool = True, after_s: float = WAIT_NOTICE_S) -> Iterator[None]:
    """Logs what the wait is for once it has lasted after_s, then that it still goes on every STILL_EVERY_S until
    the block ends (a wait told already, by an earlier call, goes on with "still"): a user never meets a silent wait."""
    if not enabled:
        yield
        return
    done = threading.Event()

    def tell() -> None:
        due = wait.started + after_s if wait.last_told is None else wait.last_told + STILL_EVERY_S
        while not done.wait(max(due - time.monotonic(), 0.0)):
            now = time.monotonic()
            if wait.last_told is None:
                log.info("%s", wait.what)
            else:
                log.info("still %s (%.0fs so far)", wait.what, now - wait.started)
            wait.last_told, due = now, now + STILL_EVERY_S

    teller = threading.Thread(target=tell, name="told-wait", daemon=True)
    teller.start()
    try:
        yield
    finally:
        done.set()
        teller.join()


def admitted_push(stub, frames: Iterator[bytes], timeout_s: float, metadata=None) -> pb.PushResponse:
    """One push stream: its header, then its chunks once the coordinator has admitted it to one of its push slots
    (its initial metadata, coordinator/limits.py PushSlots). Until then the chunks wait here, not in the
    coordinator's receive buffers."""
    admitted = threading.Event()

    def gated() -> Iterator[bytes]:
        yield next(frames)  # the header
        if not admitted.wait(SLOT_NOTICE_S):
            log.info("the push waits for one of the coordinator's push slots (it reads limits.push_slots pushes at once)")
            admitted.wait(timeout_s)
        yield from frames

    call = stub.PushPseudoGradient.future(gated(), timeout=timeout_s, metadata=metadata)
    try:
        call.initial_metadata()  # admitted, or the call ended (refused, failed, timed out)
    except BaseException:
        call.cancel()
        raise
    finally:
        admitted.set()
    return call.result()


class CoordinatorClient:
    def __init__(self, address: str, connect_timeout_s: float = 30.0, reconnect_s: float = 120.0, receive_window_bytes: int = 0,
                 tls: TlsFiles | None = None, instance: str = ""):
        """tls: this island's certificate, key and the run's CA (mutual TLS); None: plaintext. instance: the island
        process every call names (INSTANCE_KEY; islands/launch.py process_instance); "": none."""
        self.address = address
        self.instance = instance
        self.metadata = ((INSTANCE_KEY, instance),) if instance else None
        # Set by the heartbeat when the coordinator says another process joined as this island (REPLACED): the
        # island stops at its next step (islands/island.py), one line (islands/cli.py).
        self.replaced: grpc.RpcError | None = None
        self.reconnect_s = reconnect_s
        options = channel_options(receive_window_bytes)
        deadline = time.monotonic() + connect_timeout_s
        # A certificate refused, TLS on one side only, no coordinator at that port: found by our own probe, at once
        # and by name, instead of gRPC's channel retrying it until connect_timeout_s and then only timing out.
        # The wait for a coordinator not up yet says what it waits for (islands/handshake.py).
        if tls is not None:
            ca, cert, key = tls.read()
            await_coordinator(address, connect_timeout_s, tls, ca)
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=options)
        else:
            await_coordinator(address, connect_timeout_s)
            self.channel = grpc.insecure_channel(address, options=options)
        try:
            # The check above passed: give gRPC's own handshake a few seconds even if that took most of the wait.
            grpc.channel_ready_future(self.channel).result(timeout=max(deadline - time.monotonic(), 5.0))
        except grpc.FutureTimeoutError:
            self.channel.close()
            how = (" over mutual TLS; check also that it serves --tls with the same run's CA and that its certificate "
                   "names this address's host" if tls is not None else "")
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {address} within {connect_timeout_s:.0f}s{how}; "
                "check the address and that `diloco-coordinator serve` is running"
            ) from None
        self.stub = stub_for(self.channel)
        self.bytes_sent = 0
        self.bytes_received = 0
        # Codecs results may arrive in, by name; the island adds the run's downlink codec.
        self.codecs: dict[str, Codec] = {"fp32": get_codec("fp32")}
        self.on_call: CallObserver | None = None  # an island's telemetry (islands/telemetry.py)
        self.progress = True  # a large fetch shows progress on a terminal, and waits are told (off on all ranks but one)
        self._round_waits: dict[int, tuple[int, Wait]] = {}  # per fragment: the round it waits to close
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def close(self) -> None:
        self.stop_heartbeat()
        self.channel.close()

    def stop_heartbeat(self) -> None:
        """Stops heartbeating and waits for a heartbeat in flight, so that none reaches the coordinator after it."""
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5.0)

    def _retry(self, what: str, call, retry_local: bool = True):
        """Retries transient failures with backoff for up to reconnect_s (a coordinator restart).

        Transient: the coordinator unreachable or stopping (its calls cancelled), a chunk corrupted on the way (the
        push resends from where the coordinator stopped keeping), and with
        retry_local a broken stream found on our side. A pull passes
        retry_local=False: it may have added part or all of a delta already, and
        adding it again only moves further away.
        """
        delay, deadline = 0.2, time.monotonic() + self.reconnect_s
        while True:
            try:
                return call()
            except grpc.RpcError as e:
                reason = refusal_of(e).reason
                local = isinstance(e, LocalRefusal)
                transient = (
                    is_transport_failure(e) or (reason == Reason.CORRUPT_CHUNK and not local)
                    or (retry_local and local and reason in _LOCAL_RETRYABLE)
                    # A coordinator that stops cancels the calls in flight: a restart, unless we closed the channel.
                    or (e.code() == grpc.StatusCode.CANCELLED and reason == Reason.REASON_UNSPECIFIED and not local
                        and not self._heartbeat_stop.is_set())
                )
                if not transient or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s failed (%s: %s); retrying in %.1fs", what, e.code().name, e.details(), delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def join(self, config_digest: str = "", codec: str = "", island_id: str = "", island_key: str = "",
             ranks: int = 1, shard_ticket: str = "") -> pb.JoinResponse:
        """shard_ticket: joining a following shard of a sharded coordinator, the leader's ticket (islands/sharded.py)."""
        request = pb.JoinRequest(
            config_digest=config_digest, hostname=socket.gethostname(), protocol_version=PROTOCOL_VERSION,
            codec=codec, island_id=island_id, island_key=island_key, ranks=ranks, shard_ticket=shard_ticket,
        )
        return self._retry("join", lambda: self.stub.Join(request, timeout=60, metadata=self.metadata))

    def _observed(self, kind: str, fragment: int | None, round_: int, call: Callable[[list[int]], object],
                  tally: list[int] | None = None):
        """call(tally) timed and its bytes (what it adds to tally[0]) told to on_call, whether it succeeds or not."""
        tally, started, ok = tally if tally is not None else [0], time.monotonic(), False
        try:
            result = call(tally)
            ok = True
            return result
        finally:
            if self.on_call is not None:
                self.on_call(kind, fragment or 0, round_, time.monotonic() - started, tally[0], ok)

    def start_heartbeat(self, island_id: Callable[[], str], interval_s: float, round_of: Callable[[], int],
                        report: Callable[[], Mapping[str, float]] | None = None) -> None:
        """Heartbeats every interval_s; report() gives the HeartbeatRequest's utilization, tokens_per_s, train_loss."""
        def beat() -> None:
            failing = False
            while not self._heartbeat_stop.wait(interval_s):
                try:
                    request = pb.HeartbeatRequest(island_id=island_id(), round=round_of(), **(report() if report else {}))
                    self.stub.Heartbeat(request, timeout=max(interval_s, 5), metadata=self.metadata)
                    failing = False
                except grpc.RpcError as e:
                    if refusal_of(e).reason == Reason.REPLACED:  # said once, by the island as it stops
                        self.replaced = e
                        return
                    if not failing:
                        log.warning("heartbeat failed: %s %s", e.code().name, e.details())
                    failing = True

        self._heartbeat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat.start()

    def _receive(
        self,
        stream: Iterator[pb.ResultMessage],
        targets: Mapping[str, torch.Tensor],
        manifest: Manifest,
        held: str,
        ranges: list[FlatRange] | None = None,
        mean: MeanBuffer | None = None,
        tally: list[int] | None = None,
        progress: Progress | None = None,
    ) -> pb.ResultHeader:
        """Applies a result stream to targets (values, or a delta onto parameters with checksum `held`).

        With ranges, targets[name] is a flat shard holding exactly the range of
        that parameter, and the shard is verified against the header's
        ranges_checksum (the whole model's checksum is out of reach).
        """
        first = next(stream, None)
        if first is None or isinstance(first, ChunkView) or not first.HasField("header"):
            raise LocalRefusal(Reason.BAD_CHUNK, "result stream without a header")
        header = first.header
        tally = tally if tally is not None else [0]

        def got(n: int) -> None:
            self.bytes_received += n
            tally[0] += n
            if progress is not None:
                progress.update(n)

        got(first.ByteSize())
        delta = header.mode == pb.ResultHeader.DELTA
        if delta and header.base_checksum != held:
            raise LocalRefusal(Reason.CHECKSUM_MISMATCH, "delta is for other parameters than ours; fetch values")

        rest = ResultRest(stream, got)  # the chunks; the mean chunks and a trailer kept aside as they pass
        codec = self.codecs.get(header.codec)
        if codec is None:
            raise LocalRefusal(Reason.CODEC_MISMATCH, f"result codec {header.codec!r} is not this run's")
        bases = {r.name: r.offset for r in ranges} if ranges is not None else None
        expected = sum(r.numel for r in ranges) if ranges is not None else manifest.total_numel()
        # Values overwrite, so a broken stream can simply be fetched again. A delta
        # adds, so it is received whole (it is compressed: small) before it touches
        # the parameters; a retry then never adds part of it twice.
        try:
            incoming = list(rest) if delta else iter(rest)
            if delta:
                rest.complete(header)  # before anything is added: a delta that cannot be verified is never applied
            written = apply_chunks(incoming, targets, manifest, codec, add=delta, bases=bases)
            rest.complete(header)  # a streamed result's checksum and run_finished come in its trailer
        except ResultStreamError as e:
            raise LocalRefusal(Reason.BAD_CHUNK, str(e)) from e
        if written != expected:
            raise LocalRefusal(Reason.BAD_CHUNK, f"parameter stream ended early ({written} of {expected} elements)")
        if ranges is not None:
            matches = ranges_checksum((r.name, r.offset, targets[r.name]) for r in ranges) == header.ranges_checksum
        else:
            matches = checksum(targets) == header.checksum
        if not matches:
            # A pull does not retry this (retry_local=False): the trainer fetches fresh values.
            log.warning(
                "global parameters after round %d differ from the coordinator's%s (checksum); full resync",
                header.round - 1, " in our shard" if ranges is not None else "",
            )
            what = "shard does not match the coordinator's ranges checksum" if ranges is not None else "parameters do not match the coordinator's checksum"
            raise LocalRefusal(Reason.CHECKSUM_MISMATCH, f"received {what}; fetch values")
        if mean is not None:
            mean.take(rest.mean)
        return header

    def fetch(
        self, island_id: str, targets: Mapping[str, torch.Tensor], manifest: Manifest, ranges: list[FlatRange] | None = None,
        fragment: int | None = None,
    ) -> pb.ResultHeader:
        """Overwrites targets with the current global parameters (fp32 values); returns their header.

        With ranges, only those (targets then are the shards, see _receive). With
        a fragment, only its parameters (targets and manifest are the fragment's).
        """
        request = pb.FetchRequest(island_id=island_id, ranges=ranges_to_proto(ranges or ()), fragment=fragment)
        size = 4 * (sum(r.numel for r in ranges) if ranges is not None else manifest.total_numel())
        what = f"fetching the global parameters ({human_bytes(size)}) from {self.address}"
        with (told_wait(Wait(what), self.progress, after_s=0.0),
              Progress("fetching parameters", size, enabled=self.progress and size >= WORTH_SHOWING) as progress):
            def attempt(tally: list[int]) -> pb.ResultHeader:
                progress.set(0)
                return self._receive(self.stub.FetchParameters(request, metadata=self.metadata), targets, manifest, "", ranges,
                                     tally=tally, progress=progress)

            return self._observed("fetch", fragment, -1, lambda tally: self._retry("fetch", lambda: attempt(tally)))

    def pull(
        self,
        island_id: str,
        round_: int,
        targets: Mapping[str, torch.Tensor],
        manifest: Manifest,
        held: str,
        timeout_s: float,
        ranges: list[FlatRange] | None = None,
        fragment: int = 0,
        mean: MeanBuffer | None = None,
    ) -> pb.ResultHeader:
        """Waits for round_ to close, then brings targets (checksum `held`) to the new global parameters.

        With a fragment, targets and manifest are that fragment's; with mean, the
        round's mean pseudo-gradient is asked for too (eager updates).
        """
        request = pb.PullRequest(
            island_id=island_id, round=round_, timeout_s=timeout_s, accept_delta=bool(held), ranges=ranges_to_proto(ranges or ()),
            fragment=fragment, want_mean=mean is not None,
        )
        with told_wait(self._round_wait(fragment, round_), self.progress):
            result = self._observed("pull", fragment, round_, lambda tally: self._retry(
                "pull",
                lambda: self._receive(self.stub.PullRoundResult(request, timeout=timeout_s + 60, metadata=self.metadata), targets,
                                      manifest, held,
                                      ranges, mean, tally),
                retry_local=False,
            ))
        self._round_waits.pop(fragment, None)
        return result

    def _round_wait(self, fragment: int, round_: int) -> Wait:
        """The wait for this round of the fragment to close: one across the pulls that ask again while it is open."""
        known = self._round_waits.get(fragment)
        if known is not None and known[0] == round_:
            return known[1]
        what = (f"waiting for round {round_}{f' of fragment {fragment}' if fragment else ''} to close at the "
                "coordinator (it closes once every island in it has pushed, at least rounds.min_islands of them and "
                "robust.first_quorum for the run's first outer step; at rounds.deadline_s with rounds.min_islands)")
        self._round_waits[fragment] = (round_, Wait(what))
        return self._round_waits[fragment][1]

    def push(self, header: pb.PushHeader, chunks: ReplayableChunks | RegeneratingChunks) -> pb.PushResponse:
        """Streams a pseudo-gradient; after DATA_LOSS resends only what the coordinator did not keep."""
        start, tally = 0, [0]

        def counted(source: Iterator[pb.TensorChunk]) -> Iterator[pb.TensorChunk]:
            for chunk in source:
                n = framed_size(chunk)
                self.bytes_sent += n
                tally[0] += n
                yield chunk

        def attempt() -> pb.PushResponse:
            nonlocal start
            try:
                return admitted_push(self.stub, push_frames(header, counted(chunks.iter_from(start))), timeout_s=600,
                                     metadata=self.metadata)
            except grpc.RpcError as e:
                refusal = refusal_of(e)
                if refusal.reason == Reason.CORRUPT_CHUNK:
                    start += refusal.resend_from_chunk
                raise

        return self._observed("push", header.fragment, header.round, lambda _: self._retry("push", attempt), tally)

    def lease(self, island_id: str, index: int, samples: int) -> pb.LeaseResponse:
        """The island's lease number `index` of the corpus's sample positions (the same answer every time)."""
        request = pb.LeaseRequest(island_id=island_id, index=index, samples=samples)
        return self._retry("lease", lambda: self.stub.Lease(request, timeout=60, metadata=self.metadata))

    def leave(self, island_id: str, params_checksum: str, round_: int, stats: Mapping[str, float] | None = None,
              fragment_checksums: list[str] | None = None, untrained: list[tuple[int, int]] = ()) -> pb.LeaveResponse:
        """Leaves the run holding params_checksum (or, per fragment, fragment_checksums); stats (compute_s,
        wait_s, wall_s, inner_steps) go into the coordinator's report. A failed leave answers "no match"."""
        # A heartbeat that lands after the Leave is refused NOT_A_MEMBER: the run's report would count a refusal
        # no island earned.
        self.stop_heartbeat()
        try:
            request = pb.LeaveRequest(island_id=island_id, checksum=params_checksum, round=round_,
                                      fragment_checksums=fragment_checksums or [], **dict(stats or {}),
                                      untrained=[pb.SampleRange(start=a, stop=b) for a, b in untrained])
            return self.stub.Leave(request, timeout=30, metadata=self.metadata)
        except grpc.RpcError as e:
            log.warning("leave failed: %s %s", e.code().name, e.details())
            return pb.LeaveResponse(checksum_matches=False)


class LocalRefusal(grpc.RpcError):
    """A broken result stream found on our side, typed like the coordinator's own refusals."""

    def __init__(self, reason: int, details: str):
        self.refusal = pb.Refusal(reason=reason)
        self._code, self._details = status_of(reason), details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ()

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"
