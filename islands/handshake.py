"""Before an island's gRPC channel opens: a handshake of its own (TLS, or gRPC's plaintext opening), to name at once
what is wrong with the address.

gRPC's channel retries a failed handshake for its whole connect timeout and can
only say it never became ready; Python's ssl fails in milliseconds with the
exact reason (another run's CA, a name the certificate does not hold, an expired
one, this island's certificate refused, no TLS there at all), and a plaintext
probe tells a gRPC server from a TLS one or a web page (the dashboard's port). A
refusal is final; an unreachable coordinator is retried (it may start later), and
the wait says what it waits for.
"""

from __future__ import annotations

import logging
import socket
import ssl
import time
from enum import Enum

from diloco.security.credentials import TlsFiles

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0  # a wait for the coordinator says it still waits this often


class CoordinatorUnreachable(ConnectionError):
    pass


class Misdialed(CoordinatorUnreachable):
    """What answers at the address is not what this island can talk to, and waiting does not change that: a
    certificate refused, TLS on one side only, or no diloco coordinator there. One line naming it and what to do."""


class NotACoordinator(Misdialed):
    """The address answers, but neither gRPC nor TLS: a web server (the coordinator's dashboard) or something else."""


class CoordinatorTlsRefused(Misdialed):
    """The TLS handshake with the coordinator failed in a way waiting does not change: a certificate refused (its,
    or this island's), or no TLS there at all. The message is one line naming the problem and what to do."""


class _ClosedAfterHandshake(CoordinatorTlsRefused):
    """The coordinator closed the connection right after the handshake, without a word: what gRPC's server does
    when it refuses the client's certificate, and what a coordinator stopping just then might do."""


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


class Speaks(Enum):
    """What answers at an address, found without credentials (what_answers)."""
    GRPC = "plaintext gRPC"
    TLS = "TLS"
    WEB = "HTTP/1, a web page"
    OTHER = "neither gRPC nor TLS"
    NOTHING = "nothing: it closed the connection"  # a server stopping, say: worth trying again


_SETTINGS = 0x04  # an HTTP/2 frame's type: a gRPC server's first frame


def _read_some(sock: socket.socket, n: int) -> bytes | None:
    """Up to n bytes, fewer if the peer closes first; None when it stays silent past the socket's timeout."""
    answer = b""
    try:
        while len(answer) < n:
            more = sock.recv(n - len(answer))
            if not more:
                break
            answer += more
    except TimeoutError:
        return answer or None
    except ConnectionResetError:
        pass
    return answer


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TLS handshake (no certificate checked, none offered) gets a server's answer at host:port."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, context.wrap_socket(raw):
            return True
    except ssl.SSLError as e:
        return "ALERT" in (e.reason or "").upper()  # a TLS server's alert (certificate required, ...): TLS all the same
    except OSError:
        return False


def what_answers(address: str, timeout_s: float) -> Speaks:
    """What the server at address speaks, told by its answer to gRPC's plaintext opening (an HTTP/2 preface): a
    SETTINGS frame (gRPC), a web page (HTTP/1), silence or a closed connection (then a TLS handshake tells TLS).

    Raises OSError when nothing can be reached there (it may start later)."""
    host, port = _host_port(address)
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        raw.sendall(_H2_PREFACE)
        answer = _read_some(raw, 9)
    if answer and len(answer) >= 4 and answer[3] == _SETTINGS:
        return Speaks.GRPC
    if answer and (answer.startswith(b"HTTP/") or answer.lstrip().startswith(b"<")):
        return Speaks.WEB
    if answer:
        return Speaks.OTHER
    return Speaks.TLS if _speaks_tls(host, port, timeout_s) else Speaks.NOTHING


def _not_a_coordinator(address: str, speaks: Speaks) -> NotACoordinator:
    dashboard = (" (the coordinator's dashboard, --http-port, default 8470, is such a port)" if speaks is Speaks.WEB
                 else "")
    return NotACoordinator(
        f"{address} speaks {speaks.value}, not a diloco coordinator's gRPC{dashboard}; give --coordinator the port "
        "`diloco-coordinator serve` takes islands on (its --port, default 50051)"
    )


def _no_tls_there(address: str, timeout_s: float) -> Misdialed | None:
    """Why a TLS handshake at address failed without a TLS answer: a plaintext coordinator, or no coordinator at all.
    None when TLS answers there after all, or nothing does (worth trying again)."""
    try:
        speaks = what_answers(address, timeout_s)
    except OSError:
        return None
    if speaks in (Speaks.TLS, Speaks.NOTHING):
        return None
    if speaks is not Speaks.GRPC:
        return _not_a_coordinator(address, speaks)
    return CoordinatorTlsRefused(
        f"the coordinator at {address} does not speak TLS (the handshake failed: wrong version number): "
        "it serves plaintext; start it with --tls DIR (the run's certificates), or join it without --tls "
        "on a network you trust"
    )


def _raise_if_misdialed(address: str, timeout_s: float) -> None:
    found = _no_tls_there(address, timeout_s)
    if found is not None:
        raise found from None


def check_plaintext(address: str, timeout_s: float) -> None:
    """That a plaintext gRPC server answers at address: a TLS coordinator or another server there is told at once
    (gRPC's plaintext channel would retry it for its whole timeout and only time out). OSError: nothing reached."""
    speaks = what_answers(address, timeout_s)
    if speaks is Speaks.TLS:
        raise CoordinatorTlsRefused(
            f"the coordinator at {address} serves mutual TLS and this island joins in plaintext: join with --tls DIR "
            "(the run's ca.pem and this island's certificate: `diloco-certs island DIR NAME`)"
        )
    if speaks is Speaks.NOTHING:
        raise ConnectionAbortedError(f"{address} closed the connection without a word")
    if speaks is not Speaks.GRPC:
        raise _not_a_coordinator(address, speaks)


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
            if e.reason == "WRONG_VERSION_NUMBER":  # no TLS there: a plaintext gRPC server, a web page, ...
                _raise_if_misdialed(address, timeout_s)
            raise
        except TimeoutError:  # no answer to our hello: a web server waits for the rest of a request line, say
            _raise_if_misdialed(address, timeout_s)
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


def await_coordinator(address: str, timeout_s: float, tls: TlsFiles | None = None, ca_pem: bytes = b"") -> None:
    """Waits until the coordinator at address answers as this island needs (check_tls with tls, else
    check_plaintext), retrying for up to timeout_s while it cannot be reached (it may start later). Says what it
    waits for at once and that it still waits every PROGRESS_EVERY_S; a refusal (Misdialed) ends the wait at once.

    Raises Misdialed, or CoordinatorUnreachable after timeout_s naming the last error. An address in gRPC's other
    forms (dns:///..., unix:...) is left to gRPC's channel."""
    if _host_port(address) is None:
        return
    how = "mutual TLS" if tls is not None else "plaintext"
    log.info("connecting to %s (%s)", address, how)
    started = time.monotonic()
    deadline, next_note = started + timeout_s, started + PROGRESS_EVERY_S
    delay, last, refusals = 0.1, None, 0
    while True:
        try:
            attempt_s = max(0.5, min(5.0, deadline - time.monotonic()))
            if tls is not None:
                check_tls(address, tls, ca_pem, attempt_s)
            else:
                check_plaintext(address, attempt_s)
            return
        except _ClosedAfterHandshake as e:
            # A coordinator stopping just then would look the same once: believe it the second time in a row.
            refusals += 1
            if refusals >= 2:
                raise
            last = e
        except Misdialed:
            raise
        except OSError as e:  # refused, reset, timed out: the coordinator may not be up yet
            refusals, last = 0, e
        now = time.monotonic()
        if now >= deadline:
            serve = "`diloco-coordinator serve --tls`" if tls is not None else "`diloco-coordinator serve`"
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {address} within {timeout_s:.0f}s over {how} (last: "
                f"{_describe(last)}); check the address and that {serve} is running"
            )
        if now >= next_note:
            log.info("still connecting to %s (%s): %.0fs of --connect-timeout %.0fs; last: %s", address, how,
                     now - started, timeout_s, _describe(last))
            next_note = now + PROGRESS_EVERY_S
        time.sleep(min(delay, deadline - now, max(next_note - now, 0.01)))
        delay = min(delay * 2, 2.0)
