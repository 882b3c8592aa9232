"""A run's mutual-TLS credentials: its CA (ca.pem, ca.key), the coordinator's server certificate
(coordinator.pem/.key), one client certificate per island whose identity is the island's name
(island-<name>.pem/.key) and which carries the most ranks that island may declare, and a revocation
list (revoked.json). EC P-256 keys (which BoringSSL in grpc takes for client and server alike),
SHA-256 signatures, key files mode 0600."""

from __future__ import annotations

import datetime as dt
import fcntl
import ipaddress
import json
import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

CA_CERT, CA_KEY = "ca.pem", "ca.key"
COORDINATOR_CERT, COORDINATOR_KEY = "coordinator.pem", "coordinator.key"
REVOKED = "revoked.json"
ISLAND_URI_PREFIX = "diloco://island/"
ISLAND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_DNS_NAME = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")
# The most ranks an island may declare at join, in its certificate: a non-critical extension (a peer that does not
# know it ignores it) whose value is a DER INTEGER. The OID is under 2.25 (X.667: an OID made from a UUID, which
# needs no registration), UUID 06cd3d31-3ff8-46c7-b483-25abce0413b0.
RANKS_OID = x509.ObjectIdentifier("2.25.9041029959672624323692317452110402480")
MAX_RANKS = 1 << 20  # what a certificate may grant: far above any island, far below what would overflow a count
# Certificates start a few minutes in the past so that a peer whose clock lags ours accepts them.
_BACKDATE = dt.timedelta(minutes=5)


class CredentialError(ValueError):
    """A credential file or request that cannot be used; the message is one line saying why."""


@dataclass(frozen=True)
class TlsFiles:
    """One side's TLS material as local paths: the run's CA, this side's certificate and key."""

    ca: str
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(ca_pem, cert_pem, key_pem), checked: PEM, the cert signed by this CA and valid now,
        the key the cert's. Raises CredentialError naming the file and what is wrong."""
        ca_pem, cert_pem, key_pem = (read_file(p) for p in (self.ca, self.cert, self.key))
        ca, cert, key = load_cert(ca_pem, self.ca), load_cert(cert_pem, self.cert), _load_key(key_pem, self.key)
        _check_validity(ca, self.ca)
        _check_validity(cert, self.cert)
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            raise CredentialError(f"{self.cert}: not signed by the CA in {self.ca}; issue it from that CA "
                                  "(diloco-certs) or point to the CA that issued it") from None
        if _public_der(key.public_key()) != _public_der(cert.public_key()):
            raise CredentialError(f"{self.key}: this key does not match the certificate {self.cert}; "
                                  "use the .key file issued together with it")
        return ca_pem, cert_pem, key_pem


def coordinator_files(out_dir: str | Path) -> TlsFiles:
    return TlsFiles(*(str(Path(out_dir) / f) for f in (CA_CERT, COORDINATOR_CERT, COORDINATOR_KEY)))


def island_files(out_dir: str | Path, name: str) -> TlsFiles:
    return TlsFiles(*(str(Path(out_dir) / f) for f in (CA_CERT, f"island-{name}.pem", f"island-{name}.key")))


def create_ca(out_dir: str | Path, run_name: str = "diloco", days: int = 3650) -> Path:
    """A new CA for a run in out_dir (ca.pem, ca.key); refuses to replace an existing one, since
    every certificate it issued would stop working. Returns the path of ca.pem."""
    d = Path(out_dir)
    check_days(days)
    if not run_name.strip() or len(run_name) > 48:
        raise CredentialError(f"run name {run_name!r}: give 1 to 48 characters")
    for existing in (d / CA_CERT, d / CA_KEY):
        if existing.exists():
            raise CredentialError(f"{existing}: a CA already exists here; use another folder, "
                                  "or delete ca.pem and ca.key to start over (every issued certificate dies with it)")
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{run_name} CA"),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "diloco")])
    start = _now() - _BACKDATE
    cert = _certificate(name, key.public_key(), name, key, start, start + _BACKDATE + dt.timedelta(days=days),
                        [(x509.BasicConstraints(ca=True, path_length=0), True), (_key_usage(ca=True), True)])
    _write_key(d / CA_KEY, key)
    _write(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM))
    log.info("created CA %r in %s", run_name, d)
    return d / CA_CERT


def issue_coordinator(out_dir: str | Path, hosts: list[str], days: int = 825, force: bool = False) -> TlsFiles:
    """The coordinator's server certificate (coordinator.pem/.key), signed by out_dir's CA, with a
    SAN for every host islands dial: DNS names and IP addresses."""
    d = Path(out_dir)
    check_days(days)
    if not hosts:
        raise CredentialError("no hosts: give every name and address islands dial, e.g. coord.example.com,10.0.0.5")
    sans: list[x509.GeneralName] = [host_san(h) for h in hosts]
    files = coordinator_files(d)
    _refuse_existing(files, force, "the coordinator's certificate")
    ca, ca_key = _load_ca(d)
    # A CN outside the island-name alphabet, so the coordinator's certificate can never pass for an island's. Client
    # use too: a coordinator's following shards call the leading one with it (coordinator/judging.py).
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "diloco coordinator")])
    _issue(ca, ca_key, subject, sans, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], days, files)
    log.info("issued the coordinator's certificate for %s", ", ".join(hosts))
    return files


def issue_island(out_dir: str | Path, name: str, days: int = 825, force: bool = False, ranks: int | None = 1) -> TlsFiles:
    """An island's client certificate (island-<name>.pem/.key) whose identity is `name`: subject CN
    and SAN URI diloco://island/<name>, and the most ranks (replica groups x ranks per group) the
    island may declare at join (None: no such field, as certificates issued before it existed: the
    coordinator then caps at rounds.max_island_ranks). Refuses to replace one unless force, and a
    revoked name."""
    d = Path(out_dir)
    check_days(days)
    check_island_name(name)
    if ranks is not None:
        check_ranks(ranks)
    files = island_files(d, name)
    _refuse_existing(files, force, f"the certificate of island {name!r}")
    if (d / REVOKED).exists() and RevocationList(d / REVOKED).is_revoked(name):
        raise CredentialError(f"island {name!r} is revoked in {d / REVOKED}; issue the island a new name")
    ca, ca_key = _load_ca(d)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    extra = [] if ranks is None else [(x509.UnrecognizedExtension(RANKS_OID, _der_integer(ranks)), False)]
    _issue(ca, ca_key, subject, [x509.UniformResourceIdentifier(ISLAND_URI_PREFIX + name)],
           ExtendedKeyUsageOID.CLIENT_AUTH, days, files, extra=extra)
    log.info("issued island %r's certificate%s", name, "" if ranks is None else f" for at most {ranks} ranks")
    return files


def check_ranks(ranks: int) -> int:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise CredentialError(f"ranks {ranks!r}: give the island's replica groups x ranks per group, "
                              f"a whole number from 1 to {MAX_RANKS}")
    return ranks


def ranks_of(cert_pem: bytes) -> int | None:
    """The most ranks an island certificate lets its island declare; None when it carries no such field
    (issued before the field existed). Raises CredentialError when the field is there but unreadable."""
    cert = load_cert(cert_pem, "certificate")
    try:
        value = cert.extensions.get_extension_for_oid(RANKS_OID).value
    except x509.ExtensionNotFound:
        return None
    ranks = _read_der_integer(value.value) if isinstance(value, x509.UnrecognizedExtension) else None
    if ranks is None or not 1 <= ranks <= MAX_RANKS:
        raise CredentialError(f"certificate {cert.subject.rfc4514_string()!r}: its ranks field is not a number "
                              f"from 1 to {MAX_RANKS}; issue it again with `diloco-certs island DIR NAME --ranks N --force`")
    return ranks


def unranked_refusal(name: str | None) -> str:
    """Why a certificate without the ranks field may not join, and how to issue it again: one line."""
    return (f"the certificate of island {name or 'NAME'!r} carries no ranks (issued before certificates did), which "
            "would let it claim rounds.max_island_ranks ranks: issue it again with "
            f"`diloco-certs island DIR {name or 'NAME'} --ranks N --force` (N: its replica groups x ranks per group), "
            "or set rounds.allow_unranked_certificates = true on the coordinator to keep it for this run")


def ranks_from_auth_context(auth_context: dict) -> int | None:
    """ranks_of() the verified mTLS peer's certificate (gRPC's `context.auth_context()`); None without one."""
    pems = auth_context.get("x509_pem_cert") or []
    if b"ssl" not in auth_context.get("transport_security_type", []) or not pems:
        return None
    return ranks_of(pems[0])


def _der_integer(n: int) -> bytes:
    """A positive integer as DER: tag 2, a short length, big-endian two's complement (a leading zero byte
    when the top bit is set)."""
    body = n.to_bytes(n.bit_length() // 8 + 1, "big")
    return bytes([2, len(body)]) + body


def _read_der_integer(der: bytes) -> int | None:
    if len(der) < 3 or der[0] != 2 or der[1] != len(der) - 2 or der[1] > 8:
        return None
    return int.from_bytes(der[2:], "big", signed=True)


def check_island_name(name: str) -> str:
    if not isinstance(name, str) or not ISLAND_NAME.fullmatch(name):
        raise CredentialError(f"island name {name!r}: use 1 to 63 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
    return name


def identity_of(cert_pem: bytes) -> str:
    """The island name a client certificate carries: its SAN URI diloco://island/<name>, else its CN."""
    cert = load_cert(cert_pem, "certificate")
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    name = _pick_identity(uris, [str(c) for c in cns])
    if name is None:
        raise CredentialError(f"certificate {cert.subject.rfc4514_string()!r} names no island "
                              f"(no {ISLAND_URI_PREFIX}<name> URI and no valid island name as CN)")
    return name


def identity_from_auth_context(auth_context: dict) -> str | None:
    """The island name of a verified mTLS peer, from gRPC's `context.auth_context()`; None when the
    peer presented no certificate or its certificate names no island.

    grpc (C core, ssl_utils) gives an mTLS peer `transport_security_type` [b"ssl"],
    `x509_common_name`, `x509_subject`, `x509_pem_cert`, `x509_subject_alternative_name` (every SAN)
    and `peer_uri` (URI SANs); the handshake has already checked the chain against the run's CA.
    """
    if b"ssl" not in auth_context.get("transport_security_type", []) or not auth_context.get("x509_pem_cert"):
        return None
    uris = auth_context.get("peer_uri") or auth_context.get("x509_subject_alternative_name") or []
    cns = auth_context.get("x509_common_name") or []
    return _pick_identity([u.decode("utf-8", "replace") for u in uris], [c.decode("utf-8", "replace") for c in cns])


def _pick_identity(uris: list[str], cns: list[str]) -> str | None:
    named = [u[len(ISLAND_URI_PREFIX):] for u in uris if u.startswith(ISLAND_URI_PREFIX)]
    if named:
        # Two different island URIs in one certificate is not something we issue: no identity.
        return named[0] if len(set(named)) == 1 and ISLAND_NAME.fullmatch(named[0]) else None
    return cns[0] if len(cns) == 1 and ISLAND_NAME.fullmatch(cns[0]) else None


def revoke(out_dir: str | Path, name: str, reason: str = "") -> bool:
    """Adds `name` to out_dir/revoked.json (with the time and reason). Idempotent: a name already
    there keeps its first entry; unknown names are allowed (revoke before it is ever issued).
    Returns True when the name was newly revoked."""
    check_island_name(name)
    path = Path(out_dir) / REVOKED
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)  # the folder as lock: concurrent revokes keep each other's entry
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_revoked(path) if path.exists() else []
        if any(e["name"] == name for e in entries):
            return False
        entries.append({"name": name, "time": _now().isoformat(timespec="seconds"), "reason": reason})
        _write(path, (json.dumps({"revoked": entries}, indent=1) + "\n").encode())
    finally:
        os.close(lock)  # releases the lock
    log.warning("revoked island %r%s", name, f": {reason}" if reason else "")
    return True


class RevocationList:
    """The revoked island names in a revoked.json, re-read when the file changes. is_revoked is
    cheap enough for every RPC: it stats the file at most once per check_interval_s. A missing file
    is an empty list (nothing revoked yet); a file that turns unreadable keeps the last good list."""

    def __init__(self, path: str | Path, check_interval_s: float = 1.0) -> None:
        self.path = Path(path)
        self.check_interval_s = check_interval_s
        self._lock = threading.Lock()
        self._names: frozenset[str] = frozenset()
        self._stamp: tuple[int, int, int] | None = None
        self._checked_at = time.monotonic()
        self._reload(raise_errors=True)

    def is_revoked(self, name: str) -> bool:
        if time.monotonic() - self._checked_at >= self.check_interval_s:
            with self._lock:
                if time.monotonic() - self._checked_at >= self.check_interval_s:
                    self._reload(raise_errors=False)
        return name in self._names

    def names(self) -> frozenset[str]:
        self.is_revoked("")
        return self._names

    def _reload(self, raise_errors: bool) -> None:
        self._checked_at = time.monotonic()
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._stamp, self._names = None, frozenset()
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            names = frozenset(e["name"] for e in _read_revoked(self.path))
        except CredentialError as e:
            if raise_errors:
                raise
            log.error("%s; still using the previous revocation list (%d names)", e, len(self._names))
            self._stamp = stamp  # log once per change, not once per second
            return
        added = names - self._names
        if added and not raise_errors:  # a change while running, not the first load
            log.warning("revocation list %s: newly revoked %s", self.path, ", ".join(sorted(added)))
        self._stamp, self._names = stamp, names


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def check_days(days: int) -> None:
    if not isinstance(days, int) or days < 1:
        raise CredentialError(f"days {days!r}: give a whole number of days, at least 1")


def host_san(host: str) -> x509.GeneralName:
    host = host.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if not _DNS_NAME.fullmatch(host) or len(host) > 253:
        raise CredentialError(f"host {host!r}: not a DNS name or an IP address")
    return x509.DNSName(host.lower())


def _certificate(subject: x509.Name, public_key: ec.EllipticCurvePublicKey, issuer: x509.Name,
                 signing_key: ec.EllipticCurvePrivateKey, start: dt.datetime, end: dt.datetime,
                 extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def _key_usage(ca: bool) -> x509.KeyUsage:
    # A CA signs certificates only; a leaf signs TLS handshakes only (ECDHE: no key encipherment).
    return x509.KeyUsage(digital_signature=not ca, key_cert_sign=ca, crl_sign=ca, content_commitment=False,
                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                         encipher_only=False, decipher_only=False)


def _refuse_existing(files: TlsFiles, force: bool, what: str) -> None:
    existing = [p for p in (files.cert, files.key) if os.path.exists(p)]
    if existing and not force:
        raise CredentialError(f"{existing[0]}: {what} exists already; pass --force (force=True) to replace it")


def _issue(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, subject: x509.Name,
           sans: list[x509.GeneralName], usage: x509.ObjectIdentifier | list[x509.ObjectIdentifier], days: int, files: TlsFiles,
           not_before: dt.datetime | None = None, extra: list[tuple[x509.ExtensionType, bool]] = ()) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - _BACKDATE
    # Never valid past the CA: a peer would refuse the chain from that day on anyway.
    end = min(start + _BACKDATE + dt.timedelta(days=days), ca.not_valid_after_utc)
    cert = _certificate(subject, key.public_key(), ca.subject, ca_key, start, end, [
        (x509.BasicConstraints(ca=False, path_length=None), True), (_key_usage(ca=False), True),
        (x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), False), (x509.SubjectAlternativeName(sans), False),
        (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), False), *extra])
    _write_key(Path(files.key), key)
    _write(Path(files.cert), cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = d / CA_CERT, d / CA_KEY
    if not cert_path.exists() or not key_path.exists():
        raise CredentialError(f"{d}: no CA here (ca.pem and ca.key); create one with `diloco-certs init {d} --hosts ...`")
    ca = load_cert(read_file(str(cert_path)), str(cert_path))
    key = _load_key(read_file(str(key_path)), str(key_path))
    if _public_der(key.public_key()) != _public_der(ca.public_key()):
        raise CredentialError(f"{key_path}: this key does not match the CA certificate {cert_path}")
    _check_validity(ca, str(cert_path))
    return ca, key  # type: ignore[return-value]


def read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise CredentialError(f"{path}: missing; copy it from the run's credentials folder (diloco-certs init)") from None
    except OSError as e:
        raise CredentialError(f"{path}: cannot read it ({e.strerror})") from None


def load_cert(pem: bytes, source: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError:
        raise CredentialError(f"{source}: not a PEM certificate (expected -----BEGIN CERTIFICATE-----)") from None


def _load_key(pem: bytes, source: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except TypeError:
        raise CredentialError(f"{source}: the key is encrypted; grpc needs an unencrypted key file (mode 0600)") from None
    except (ValueError, UnsupportedAlgorithm) as e:
        raise CredentialError(f"{source}: not a PEM private key ({type(e).__name__})") from None
    return key  # type: ignore[return-value]


def _check_validity(cert: x509.Certificate, source: str) -> None:
    now = _now()
    if now < cert.not_valid_before_utc:
        raise CredentialError(f"{source}: not yet valid (from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC); "
                              "check this machine's clock")
    if now > cert.not_valid_after_utc:
        raise CredentialError(f"{source}: expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                              "issue a new one (diloco-certs)")


def _public_der(public_key: object) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER,  # type: ignore[attr-defined]
                                   serialization.PublicFormat.SubjectPublicKeyInfo)


def _read_revoked(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
        entries = data["revoked"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                                    for e in entries):
            raise TypeError
        return entries
    except FileNotFoundError:  # deleted between stat and read: nothing revoked
        return []
    except (ValueError, KeyError, TypeError):
        raise CredentialError(f"{path}: not a revocation list ({{\"revoked\": [{{\"name\": ...}}]}}); "
                              "fix or delete it") from None


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    _write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()), mode=0o600)


def _write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Atomically (temp file + rename): a reader sees the old file or the new, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)  # before any byte of a key is written
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
