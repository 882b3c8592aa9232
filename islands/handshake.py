"""Before an island's gRPC channel opens: one TLS handshake of its own, to name a refused certificate at once.

gRPC's channel retries a failed handshake for its whole connect timeout and can
only say it never became ready; Python's ssl fails in milliseconds with the
exact reason (another run's CA, a name the certificate does not hold, an expired
one, this island's certificate refused, no TLS there at all). A refusal is
final; an unreachable coordinator is retried (it may start later).
"""

from __future__ import annotations

import socket
import ssl
import time

from diloco.security.credentials import TlsFiles


class CoordinatorUnreachable(ConnectionError):
    pass


class CoordinatorTlsRefused(CoordinatorUnreachable):
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

    Raises CoordinatorTlsRefused, or CoordinatorUnreachable after timeout_s naming the last error. An address in
    gRPC's other forms (dns:///..., unix:...) is left to gRPC's channel."""
    if _host_port(address) is None:
        return
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
