"""A run's mTLS credentials (diloco.security.credentials, diloco-certs): issuing, checking, identity,
revocation, and a real gRPC server on loopback that verifies islands against the run's CA."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.security import credentials as cr
from diloco.security.credentials import CredentialError, RevocationList, TlsFiles


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "creds"
    cr.create_ca(d, run_name="test-run")
    cr.issue_coordinator(d, ["127.0.0.1", "localhost", "coord.example.com", "10.0.0.5"])
    cr.issue_island(d, "east")
    cr.issue_island(d, "west")
    return d


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message and message
    return message


def issue_at(d: Path, name: str, start: dt.datetime, days: int, out: str) -> TlsFiles:
    """An island certificate valid from `start` (the public functions only issue from now)."""
    ca, ca_key = cr._load_ca(d)
    files = TlsFiles(str(d / cr.CA_CERT), str(d / f"{out}.pem"), str(d / f"{out}.key"))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cr._issue(ca, ca_key, subject, [x509.UniformResourceIdentifier(cr.ISLAND_URI_PREFIX + name)],
              ExtendedKeyUsageOID.CLIENT_AUTH, days, files, not_before=start)
    return files


# -- issuing -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_run_dir_holds_the_ca_the_coordinator_and_each_island(run_dir: Path):
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == ["ca.key", "ca.pem", "coordinator.key", "coordinator.pem",
                     "island-east.key", "island-east.pem", "island-west.key", "island-west.pem"]
    for key in run_dir.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    ca_pem, cert_pem, key_pem = cr.coordinator_files(run_dir).read()
    assert ca_pem.startswith(b"-----BEGIN CERTIFICATE-----") and b"PRIVATE KEY" in key_pem
    coordinator = x509.load_pem_x509_certificate(cert_pem)
    san = coordinator.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sorted(san.get_values_for_type(x509.DNSName)) == ["coord.example.com", "localhost"]
    assert sorted(map(str, san.get_values_for_type(x509.IPAddress))) == ["10.0.0.5", "127.0.0.1"]
    eku = coordinator.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # Client use too: a sharded coordinator's followers call the leader with it (its CN names no island).
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    island = x509.load_pem_x509_certificate(cr.island_files(run_dir, "east").read()[1])
    assert list(island.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert isinstance(island.public_key(), ec.EllipticCurvePublicKey) and island.public_key().curve.name == "secp256r1"
    assert island.signature_hash_algorithm.name == "sha256"


@pytest.mark.unit
def test_the_ca_is_never_replaced(run_dir: Path):
    before = (run_dir / "ca.pem").read_bytes()
    with pytest.raises(CredentialError) as e:
        cr.create_ca(run_dir)
    assert "a CA already exists" in one_line(e)
    assert (run_dir / "ca.pem").read_bytes() == before


@pytest.mark.unit
@pytest.mark.parametrize("name", ["", "-east", ".east", "east west", "a/b", "x" * 64, "östra", "e\n"])
def test_island_names_outside_the_alphabet_are_refused(run_dir: Path, name: str):
    with pytest.raises(CredentialError) as e:
        cr.issue_island(run_dir, name)
    assert "island name" in one_line(e)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["a", "9", "east-1.dc_2", "x" * 63])
def test_island_names_in_the_alphabet_are_issued(run_dir: Path, name: str):
    files = cr.issue_island(run_dir, name)
    assert cr.identity_of(files.read()[1]) == name


@pytest.mark.unit
def test_an_island_is_reissued_only_with_force(run_dir: Path):
    before = cr.island_files(run_dir, "east").read()
    with pytest.raises(CredentialError) as e:
        cr.issue_island(run_dir, "east")
    assert "--force" in one_line(e)
    assert cr.issue_island(run_dir, "east", force=True).read()[2] != before[2]


@pytest.mark.unit
def test_bad_hosts_days_and_a_missing_ca_are_one_line_errors(run_dir: Path, tmp_path: Path):
    for hosts, expected in ([], "no hosts"), (["bad host"], "not a DNS name"), (["a..b"], "not a DNS name"):
        with pytest.raises(CredentialError) as e:
            cr.issue_coordinator(run_dir, hosts, force=True)
        assert expected in one_line(e)
    with pytest.raises(CredentialError) as e:
        cr.issue_island(run_dir, "north", days=0)
    assert "days" in one_line(e)
    with pytest.raises(CredentialError) as e:
        cr.issue_island(tmp_path / "empty", "north")
    assert "no CA here" in one_line(e)


# -- checking what a side loads ------------------------------------------------------------------


@pytest.mark.unit
def test_every_unusable_file_is_a_one_line_error_naming_it(run_dir: Path, tmp_path: Path):
    east = cr.island_files(run_dir, "east")
    other = tmp_path / "other"
    cr.create_ca(other)
    cr.issue_island(other, "east")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    expired = issue_at(run_dir, "east", cr._now() - dt.timedelta(days=10), 1, "expired")
    future = issue_at(run_dir, "east", cr._now() + dt.timedelta(days=2), 30, "future")
    cases = {
        "missing": (TlsFiles(east.ca, str(tmp_path / "nope.pem"), east.key), "nope.pem: missing"),
        "cert not PEM": (TlsFiles(east.ca, str(tmp_path / "junk.pem"), east.key), "junk.pem: not a PEM certificate"),
        "CA not PEM": (TlsFiles(str(tmp_path / "junk.pem"), east.cert, east.key), "junk.pem: not a PEM certificate"),
        "key not PEM": (TlsFiles(east.ca, east.cert, str(tmp_path / "junk.pem")), "junk.pem: not a PEM private key"),
        "key is a cert": (TlsFiles(east.ca, east.cert, east.cert), "island-east.pem: not a PEM private key"),
        "another CA": (TlsFiles(east.ca, str(other / "island-east.pem"), str(other / "island-east.key")),
                       "not signed by the CA"),
        "expired": (expired, "expired.pem: expired on"),
        "not yet valid": (future, "future.pem: not yet valid"),
        "key of another cert": (TlsFiles(east.ca, east.cert, str(run_dir / "island-west.key")),
                                "island-west.key: this key does not match"),
    }
    for case, (files, expected) in cases.items():
        with pytest.raises(CredentialError) as e:
            files.read()
        assert expected in one_line(e), case


@pytest.mark.unit
def test_identity_of_a_certificate(run_dir: Path):
    assert cr.identity_of(cr.island_files(run_dir, "west").read()[1]) == "west"
    with pytest.raises(CredentialError) as e:  # the coordinator's CN is outside the island alphabet
        cr.identity_of((run_dir / "coordinator.pem").read_bytes())
    assert "names no island" in one_line(e)
    with pytest.raises(CredentialError):
        cr.identity_of(b"junk")
    # a certificate with only a CN (no island URI): the CN is the identity
    ca, ca_key = cr._load_ca(run_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = cr._now()
    plain = cr._certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "south")]), key.public_key(),
                            ca.subject, ca_key, now, now + dt.timedelta(days=1), [])
    assert cr.identity_of(plain.public_bytes(serialization.Encoding.PEM)) == "south"


@pytest.mark.unit
def test_identity_from_auth_context_shapes():
    mtls = {"transport_security_type": [b"ssl"], "x509_common_name": [b"east"], "x509_pem_cert": [b"-----"],
            "x509_subject_alternative_name": [b"diloco://island/east"], "peer_uri": [b"diloco://island/east"]}
    assert cr.identity_from_auth_context(mtls) == "east"
    assert cr.identity_from_auth_context({**mtls, "peer_uri": [], "x509_subject_alternative_name": []}) == "east"
    assert cr.identity_from_auth_context({**mtls, "peer_uri": [b"diloco://island/a", b"diloco://island/b"]}) is None
    assert cr.identity_from_auth_context({**mtls, "peer_uri": [], "x509_subject_alternative_name": [],
                                          "x509_common_name": [b"diloco coordinator"]}) is None
    assert cr.identity_from_auth_context({"transport_security_type": [b"ssl"]}) is None  # no client certificate
    assert cr.identity_from_auth_context({}) is None  # plaintext
    assert cr.identity_from_auth_context({"transport_security_type": [b"insecure"], **{k: v for k, v in mtls.items()
                                          if k != "transport_security_type"}}) is None


# -- revocation ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_revoke_appends_idempotently_and_atomically(run_dir: Path):
    assert cr.revoke(run_dir, "east", reason="key leaked") is True
    assert cr.revoke(run_dir, "east", reason="again") is False
    assert cr.revoke(run_dir, "never-issued") is True
    entries = json.loads((run_dir / "revoked.json").read_text())["revoked"]
    assert [(e["name"], e["reason"]) for e in entries] == [("east", "key leaked"), ("never-issued", "")]
    assert dt.datetime.fromisoformat(entries[0]["time"]).tzinfo is not None
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # no temp file left behind
    with pytest.raises(CredentialError) as e:
        cr.revoke(run_dir, "../x")
    one_line(e)
    with pytest.raises(CredentialError) as e:  # a revoked name is not issued again, even with force
        cr.issue_island(run_dir, "east", force=True)
    assert "revoked" in one_line(e)


@pytest.mark.unit
def test_concurrent_revokes_keep_every_name(tmp_path: Path):
    threads = [threading.Thread(target=cr.revoke, args=(tmp_path, f"island-{i}")) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert RevocationList(tmp_path / "revoked.json").names() == {f"island-{i}" for i in range(16)}


@pytest.mark.unit
def test_the_revocation_list_rereads_a_changed_file(tmp_path: Path):
    path = tmp_path / "revoked.json"
    live = RevocationList(path, check_interval_s=0)
    assert not live.is_revoked("east")  # no file yet: nothing revoked
    cr.revoke(tmp_path, "east")
    assert live.is_revoked("east") and not live.is_revoked("west")
    cr.revoke(tmp_path, "west")
    assert live.is_revoked("west")
    path.write_text("{not json")  # a broken edit keeps the last good list
    assert live.is_revoked("east") and live.is_revoked("west")
    path.write_text(json.dumps({"revoked": [{"name": "west"}]}))
    assert not live.is_revoked("east") and live.is_revoked("west")
    path.unlink()
    assert not live.is_revoked("west")


@pytest.mark.unit
def test_the_revocation_list_stats_at_most_once_per_interval(tmp_path: Path, monkeypatch):
    cr.revoke(tmp_path, "east")
    slow = RevocationList(tmp_path / "revoked.json", check_interval_s=3600)
    cr.revoke(tmp_path, "west")
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(cr.os, "stat", lambda p, *a, **k: stats.append(p) or real_stat(p, *a, **k))
    assert all(slow.is_revoked("east") for _ in range(1000)) and not slow.is_revoked("west")
    assert stats == []
    slow._checked_at -= 3600  # as if an hour passed
    assert slow.is_revoked("west") and len(stats) == 1


@pytest.mark.unit
def test_a_broken_revocation_file_is_an_error_at_load(tmp_path: Path):
    for text in ("{", "[]", '{"revoked": [{"reason": "x"}]}'):
        (tmp_path / "revoked.json").write_text(text)
        with pytest.raises(CredentialError) as e:
            RevocationList(tmp_path / "revoked.json")
        assert "not a revocation list" in one_line(e)


# -- the command ---------------------------------------------------------------------------------


def certs(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli.certs", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.integration
def test_the_command_issues_revokes_and_shows(tmp_path: Path):
    d = tmp_path / "run"
    r = certs("init", str(d), "--hosts", "coord.example.com,10.0.0.5", "--islands", "east,west", "--days", "30")
    assert r.returncode == 0, r.stderr
    assert f"coordinator: {d}/ca.pem, {d}/coordinator.pem, {d}/coordinator.key" in r.stdout
    assert f"island west: {d}/ca.pem, {d}/island-west.pem, {d}/island-west.key" in r.stdout
    cr.coordinator_files(d).read()
    assert certs("island", str(d), "north").returncode == 0
    assert cr.identity_of(cr.island_files(d, "north").read()[1]) == "north"
    r = certs("revoke", str(d), "west", "--reason", "decommissioned")
    assert r.returncode == 0 and "revoked island west" in r.stdout
    assert RevocationList(d / "revoked.json").is_revoked("west")
    r = certs("show", str(d / "island-east.pem"))
    assert r.returncode == 0 and "island east" in r.stdout and "diloco://island/east" in r.stdout
    assert "valid now" in r.stdout and "CN=test" not in r.stdout and "diloco CA" in r.stdout
    r = certs("show", str(d / "coordinator.pem"))
    assert "coord.example.com, 10.0.0.5" in r.stdout and "serverAuth" in r.stdout
    assert certs("coordinator", str(d), "--hosts", "127.0.0.1").returncode == 0


@pytest.mark.integration
@pytest.mark.parametrize("args, expected", [
    (["init", "{d}", "--hosts", "a"], "a CA already exists"),
    (["init", "{d}2", "--hosts", "a", "--islands", "ok,bad name"], "island name 'bad name'"),
    (["init", "{d}2", "--hosts", "bad host"], "not a DNS name"),
    (["init", "{d}2", "--hosts", ","], "--hosts"),
    (["init", "{d}2", "--hosts", "a", "--islands", "x,x"], "appears twice"),
    (["island", "{d}", "east"], "--force"),
    (["island", "{d}", "--", "-x"], "island name"),
    (["revoke", "{d}", "a b"], "island name"),
    (["show", "{d}/nope.pem"], "missing"),
    (["show", "{d}/island-east.key"], "not a PEM certificate"),
    (["frob"], "invalid choice"),
    ([], "required"),
])
def test_the_command_refuses_bad_input_in_one_line(run_dir: Path, args: list[str], expected: str):
    r = certs(*(a.replace("{d}", str(run_dir)) for a in args))
    assert r.returncode == 2, r
    assert r.stderr.startswith("diloco-certs") and r.stderr.count("\n") == 1 and expected in r.stderr, r.stderr
    assert not Path(f"{run_dir}2").exists()  # a refused init writes nothing


# -- a real gRPC server with mutual TLS over loopback --------------------------------------------


class Server:
    """A gRPC server on 127.0.0.1 that requires a client certificate from the CA `ca` and answers
    /t.Who/Am with the island identity it sees."""

    def __init__(self, ca: bytes, cert: bytes, key: bytes) -> None:
        self.seen: list[dict] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.unary_unary_rpc_method_handler(self._who)
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.Who", {"Am": handler})])
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        self.port = self.server.add_secure_port("127.0.0.1:0", creds)
        self.server.start()

    def _who(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        auth = context.auth_context()
        self.seen.append(auth)
        return (cr.identity_from_auth_context(auth) or "<none>").encode()

    def call(self, ca: bytes, key: bytes | None = None, cert: bytes | None = None) -> bytes:
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        with grpc.secure_channel(f"127.0.0.1:{self.port}", creds) as channel:  # no target-name override
            return channel.unary_unary("/t.Who/Am")(b"", timeout=10)

    def refuses(self, ca: bytes, key: bytes | None = None, cert: bytes | None = None) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as e:
            self.call(ca, key, cert)
        assert self.seen == []  # the handshake failed: no handler ran
        return e.value.code()


@pytest.fixture
def server(run_dir: Path):
    s = Server(*cr.coordinator_files(run_dir).read())
    try:
        yield s
    finally:
        s.server.stop(grace=None)


@pytest.mark.integration
def test_an_island_is_known_by_its_certificate(server: Server, run_dir: Path):
    ca, cert, key = cr.island_files(run_dir, "east").read()
    assert server.call(ca, key, cert) == b"east"
    ca, cert, key = cr.island_files(run_dir, "west").read()
    assert server.call(ca, key, cert) == b"west"
    auth = server.seen[-1]
    # what grpc's auth_context gives for an mTLS peer, as identity_from_auth_context reads it
    assert auth["transport_security_type"] == [b"ssl"]
    assert auth["x509_common_name"] == [b"west"]
    assert auth["peer_uri"] == [b"diloco://island/west"]
    assert auth["x509_subject_alternative_name"] == [b"diloco://island/west"]
    assert auth["x509_pem_cert"][0].strip() == cert.strip()


@pytest.mark.integration
def test_clients_without_a_good_certificate_are_refused_at_the_handshake(server: Server, run_dir: Path,
                                                                        tmp_path: Path):
    ca = (run_dir / "ca.pem").read_bytes()
    assert server.refuses(ca) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    other = tmp_path / "other"
    cr.create_ca(other)
    stranger = cr.issue_island(other, "east")  # the right name, from another CA
    assert server.refuses(ca, Path(stranger.key).read_bytes(), Path(stranger.cert).read_bytes()) \
        == grpc.StatusCode.UNAVAILABLE
    expired = issue_at(run_dir, "east", cr._now() - dt.timedelta(days=10), 1, "expired")
    assert server.refuses(ca, Path(expired.key).read_bytes(), Path(expired.cert).read_bytes()) \
        == grpc.StatusCode.UNAVAILABLE
    # The coordinator's own certificate passes the handshake as a client (a sharded coordinator's followers call the
    # leader with it, coordinator/judging.py) but names no island: it can act as none (nor watch: _credential).
    assert server.call(ca, (run_dir / "coordinator.key").read_bytes(), (run_dir / "coordinator.pem").read_bytes()) == b"<none>"


@pytest.mark.integration
def test_an_island_refuses_a_coordinator_it_cannot_verify(server: Server, run_dir: Path, tmp_path: Path):
    ca, cert, key = cr.island_files(run_dir, "east").read()
    other = tmp_path / "other"
    cr.create_ca(other)
    # an island that trusts another CA refuses the run's coordinator
    assert server.refuses((other / "ca.pem").read_bytes(), key, cert) == grpc.StatusCode.UNAVAILABLE
    # a server with a certificate from another CA is refused by an island trusting the run's CA
    cr.issue_coordinator(other, ["127.0.0.1"])
    impostor = Server(ca, (other / "coordinator.pem").read_bytes(), (other / "coordinator.key").read_bytes())
    try:
        assert impostor.refuses(ca, key, cert) == grpc.StatusCode.UNAVAILABLE
    finally:
        impostor.server.stop(grace=None)
    # the run's own coordinator certificate, but not for the address dialled: refused too
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for f in ("ca.pem", "ca.key"):
        (elsewhere / f).write_bytes((run_dir / f).read_bytes())
    cr.issue_coordinator(elsewhere, ["coord.example.com"])
    misnamed = Server(*cr.coordinator_files(elsewhere).read())
    try:
        assert misnamed.refuses(ca, key, cert) == grpc.StatusCode.UNAVAILABLE
    finally:
        misnamed.server.stop(grace=None)
