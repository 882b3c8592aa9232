"""An island's connection to the coordinator: join, heartbeat, fetch, push, pull, leave."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

import grpc
import torch

from diloco.codec import Codec, get_codec
from diloco.credentials import TlsFiles
from diloco.frames import ChunkView, ResultRest, ResultStreamError, push_frames, stub_for
from diloco.params import checksum, ranges_checksum
from diloco.progress import WORTH_SHOWING, Progress
from diloco.refusal import Reason, is_transport_failure, refusal_of, status_of
from diloco.v1 import diloco_pb2 as pb
from diloco.wire import PROTOCOL_VERSION, FlatRange, Manifest, apply_chunks, framed_size, ranges_to_proto

log = logging.getLogger(__name__)

# Broken streams found on our side that a fetch (values overwrite) may simply try again.
_LOCAL_RETRYABLE = {Reason.BAD_CHUNK, Reason.CHECKSUM_MISMATCH}

# Told of every push, pull and fetch call as it ends: (kind, fragment, round, seconds, bytes, ok).
CallObserver = Callable[[str, int, int, float, int, bool], None]


class CoordinatorUnreachable(ConnectionError):
    pass


class CoordinatorTlsRefused(CoordinatorUnreachable):
    """The TLS handshake with the coordinator failed in a way waiting does not change: a certificate refused (its,
    or this island's), or no TLS there at all. The message is one line naming the problem and what to do."""


class _ClosedAfterHandshake(CoordinatorTlsRefused):
    """The coordinator closed the connection right after the handshake, without a word: what gRPC's server does
    when it refuses the client's certificate, and what a coordinator stopping just then might do."""


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
    """

    def __init__(self, factory: Callable[[int], Iterator[pb.TensorChunk]]):
        self._factory = factory

    def iter_from(self, start: int) -> Iterator[pb.TensorChunk]:
        return self._factory(start)


def channel_options(receive_window_bytes: int = 0) -> list[tuple[str, int]]:
    """gRPC options for an island's connection.

    receive_window_bytes > 0 fixes each stream's HTTP/2 receive window instead
    of letting gRPC grow it by probing the bandwidth-delay product. The window
    bounds what the transport buffers while the island applies a result chunk
    by chunk; a slow (CPU-starved) receiver otherwise lets it grow to the
    size of the whole stream. Throughput per stream is about window / RTT, so
    size it near bandwidth x RTT.
    """
    if receive_window_bytes <= 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", receive_window_bytes)]


# An HTTP/2 client's connection preface and an empty SETTINGS frame: what gRPC sends first after the handshake.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# Verification results (OpenSSL's X509_V_ERR_*) that mean "signed by another CA than ours".
_OTHER_CA = {2, 7, 18, 19, 20, 21, 30, 31, 32}
_NAME_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_NOT_VALID_NOW = {9, 10}  # X509_V_ERR_CERT_NOT_YET_VALID, X509_V_ERR_CERT_HAS_EXPIRED


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a HOST:PORT or [V6]:PORT address; None for gRPC's other target forms (dns:///..., unix:...)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address or (":" in host and not host.startswith("[")):
        return None
    return host.strip("[]"), int(port)


def _peer_refused_us(e: ssl.SSLError) -> bool:
    """An alert from the peer about this side's certificate (tlsv13 alert certificate required, unknown ca, ...)."""
    reason = (e.reason or "").upper()
    return "ALERT" in reason and any(w in reason for w in ("CERTIFICATE", "UNKNOWN_CA", "ACCESS_DENIED"))


def _our_certificate_refused(address: str, tls: TlsFiles, how: str,
                             kind: type[CoordinatorTlsRefused] = CoordinatorTlsRefused) -> CoordinatorTlsRefused:
    return kind(
        f"the coordinator at {address} refused this island's certificate {tls.cert} ({how}): it does not trust the "
        f"CA that issued it (the one in {tls.ca}), so the coordinator serves another run's credentials, or this island "
        "was given another run's; use an island certificate issued from the CA in the coordinator's --tls folder "
        "(`diloco-certs island DIR NAME`) and that folder's ca.pem"
    )


def _their_certificate_refused(address: str, host: str, tls: TlsFiles, e: ssl.SSLCertVerificationError) -> CoordinatorTlsRefused:
    why = e.verify_message or e.reason or str(e)
    if e.verify_code in _OTHER_CA:
        return CoordinatorTlsRefused(
            f"the coordinator's certificate at {address} is not signed by the run's CA in {tls.ca} ({why}): the "
            "coordinator serves another run's credentials, or this island was given another run's; use the ca.pem "
            "and island certificate from the folder the coordinator's --tls was made with (`diloco-certs`)"
        )
    if e.verify_code in _NAME_MISMATCH:
        return CoordinatorTlsRefused(
            f"the coordinator's certificate at {address} does not name {host} ({why}): dial it at a name or address "
            "its certificate holds (`diloco-certs show coordinator.pem`), or re-issue it with this one "
            "(`diloco-certs coordinator DIR --hosts ...`)"
        )
    if e.verify_code in _NOT_VALID_NOW:
        return CoordinatorTlsRefused(
            f"the coordinator's certificate at {address} is not valid now ({why}): re-issue it "
            "(`diloco-certs coordinator DIR --hosts ...`), or correct this machine's clock"
        )
    return CoordinatorTlsRefused(f"the coordinator's certificate at {address} fails verification against the run's CA "
                                 f"in {tls.ca} ({why}); check it with `diloco-certs show`")


def check_tls(address: str, tls: TlsFiles, ca_pem: bytes, timeout_s: float) -> None:
    """One TLS handshake with the coordinator as gRPC's would go (this island's certificate, the run's CA, the
    certificate checked against the address's host), with Python's ssl: it fails in milliseconds with the exact
    reason where gRPC's channel retries for its whole timeout and can only say it never became ready.

    Raises CoordinatorTlsRefused when a certificate is refused, either side's; OSError when the coordinator cannot
    be reached or the connection breaks (it may not be up yet: worth retrying). Returns once the coordinator
    answered on the connection (it accepted this island's certificate: in TLS 1.3 the server judges the client's
    certificate after the client's handshake is done), or did not answer within timeout_s (gRPC will tell)."""
    host, port = _host_port(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer's certificate and its name
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cadata=ca_pem.decode("ascii", errors="replace"))
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        try:
            conn = context.wrap_socket(raw, server_hostname=host)
        except ssl.SSLCertVerificationError as e:
            raise _their_certificate_refused(address, host, tls, e) from None
        except ssl.SSLError as e:
            if _peer_refused_us(e):
                raise _our_certificate_refused(address, tls, e.reason.lower().replace("_", " ")) from None
            if e.reason == "WRONG_VERSION_NUMBER":  # what a plaintext gRPC server answers a TLS hello with
                raise CoordinatorTlsRefused(
                    f"the coordinator at {address} does not speak TLS (the handshake failed: wrong version number): "
                    "it serves plaintext; start it with --tls DIR (the run's certificates), or join it without --tls "
                    "on a network you trust"
                ) from None
            raise
        with conn:
            try:
                conn.sendall(_H2_PREFACE)
                answer = conn.recv(9)
            except ssl.SSLError as e:
                if _peer_refused_us(e):
                    raise _our_certificate_refused(address, tls, e.reason.lower().replace("_", " ")) from None
                raise
            except TimeoutError:
                return
            if not answer:
                # gRPC's server closes without an alert when it refuses the client's certificate.
                raise _our_certificate_refused(address, tls, "it closed the connection right after the TLS handshake",
                                               _ClosedAfterHandshake)


def _describe(e: BaseException | None) -> str:
    if isinstance(e, ssl.SSLError):
        return f"the TLS handshake failed: {e.reason or e}; does it serve --tls?"
    if isinstance(e, OSError):
        return e.strerror or str(e) or type(e).__name__
    return str(e)


def await_tls(address: str, tls: TlsFiles, ca_pem: bytes, timeout_s: float) -> None:
    """check_tls until the coordinator accepts this island's TLS, retrying for up to timeout_s while it cannot be
    reached (it may start later); a refused certificate ends the wait at once.

    Raises CoordinatorTlsRefused, or CoordinatorUnreachable after timeout_s naming the last error."""
    deadline = time.monotonic() + timeout_s
    delay, last, refusals = 0.1, None, 0
    while True:
        try:
            check_tls(address, tls, ca_pem, max(0.5, min(5.0, deadline - time.monotonic())))
            return
        except _ClosedAfterHandshake as e:
            # A coordinator stopping just then would look the same once: believe it the second time in a row.
            refusals += 1
            if refusals >= 2:
                raise
            last = e
        except CoordinatorTlsRefused:
            raise
        except OSError as e:  # refused, reset, timed out: the coordinator may not be up yet
            refusals, last = 0, e
        left = deadline - time.monotonic()
        if left <= 0:
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {address} within {timeout_s:.0f}s over mutual TLS (last: "
                f"{_describe(last)}); check the address and that `diloco-coordinator serve --tls` is running"
            )
        time.sleep(min(delay, left))
        delay = min(delay * 2, 2.0)


class CoordinatorClient:
    def __init__(self, address: str, connect_timeout_s: float = 30.0, reconnect_s: float = 120.0, receive_window_bytes: int = 0,
                 tls: TlsFiles | None = None):
        """tls: this island's certificate, key and the run's CA (mutual TLS); None: plaintext."""
        self.address = address
        self.reconnect_s = reconnect_s
        options = channel_options(receive_window_bytes)
        deadline = time.monotonic() + connect_timeout_s
        if tls is not None:
            ca, cert, key = tls.read()
            if _host_port(address) is not None:
                # A certificate problem found by our own handshake: at once and by name, instead of gRPC's channel
                # retrying it (logging each handshake) until connect_timeout_s and then only timing out.
                await_tls(address, tls, ca, connect_timeout_s)
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        try:
            # The TLS check above passed: give gRPC's own handshake a few seconds even if that took most of the wait.
            grpc.channel_ready_future(self.channel).result(timeout=max(deadline - time.monotonic(), 5.0 if tls else 0.0))
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
        self.progress = True  # a large fetch shows progress on a terminal (off on all ranks but one)
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def close(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(5.0)
        self.channel.close()

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
             ranks: int = 1) -> pb.JoinResponse:
        request = pb.JoinRequest(
            config_digest=config_digest, hostname=socket.gethostname(), protocol_version=PROTOCOL_VERSION,
            codec=codec, island_id=island_id, island_key=island_key, ranks=ranks,
        )
        return self._retry("join", lambda: self.stub.Join(request, timeout=60))

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
                    self.stub.Heartbeat(request, timeout=max(interval_s, 5))
                    failing = False
                except grpc.RpcError as e:
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
        with Progress("fetching parameters", size, enabled=self.progress and size >= WORTH_SHOWING) as progress:
            def attempt(tally: list[int]) -> pb.ResultHeader:
                progress.set(0)
                return self._receive(self.stub.FetchParameters(request), targets, manifest, "", ranges, tally=tally,
                                     progress=progress)

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
        return self._observed("pull", fragment, round_, lambda tally: self._retry(
            "pull",
            lambda: self._receive(self.stub.PullRoundResult(request, timeout=timeout_s + 60), targets, manifest, held, ranges, mean,
                                  tally),
            retry_local=False,
        ))

    def push(self, header: pb.PushHeader, chunks: ReplayableChunks | RegeneratingChunks) -> pb.PushResponse:
        """Streams a pseudo-gradient; after DATA_LOSS resends only what the coordinator did not keep."""
        start, tally = 0, [0]

        def counted(source: Iterator[pb.TensorChunk]) -> Iterator[pb.TensorChunk]:
            for chunk in source:
                n = framed_size(chunk)
                self.bytes_sent += n
                tally[0] += n
                yield chunk

        def messages() -> Iterator[bytes]:
            return push_frames(header, counted(chunks.iter_from(start)))

        def attempt() -> pb.PushResponse:
            nonlocal start
            try:
                return self.stub.PushPseudoGradient(messages(), timeout=600)
            except grpc.RpcError as e:
                refusal = refusal_of(e)
                if refusal.reason == Reason.CORRUPT_CHUNK:
                    start += refusal.resend_from_chunk
                raise

        return self._observed("push", header.fragment, header.round, lambda _: self._retry("push", attempt), tally)

    def lease(self, island_id: str, index: int, samples: int) -> pb.LeaseResponse:
        """The island's lease number `index` of the corpus's sample positions (the same answer every time)."""
        request = pb.LeaseRequest(island_id=island_id, index=index, samples=samples)
        return self._retry("lease", lambda: self.stub.Lease(request, timeout=60))

    def leave(self, island_id: str, params_checksum: str, round_: int, stats: Mapping[str, float] | None = None,
              fragment_checksums: list[str] | None = None, untrained: list[tuple[int, int]] = ()) -> pb.LeaveResponse:
        """Leaves the run holding params_checksum (or, per fragment, fragment_checksums); stats (compute_s,
        wait_s, wall_s, inner_steps) go into the coordinator's report. A failed leave answers "no match"."""
        try:
            request = pb.LeaveRequest(island_id=island_id, checksum=params_checksum, round=round_,
                                      fragment_checksums=fragment_checksums or [], **dict(stats or {}),
                                      untrained=[pb.SampleRange(start=a, stop=b) for a, b in untrained])
            return self.stub.Leave(request, timeout=30)
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
