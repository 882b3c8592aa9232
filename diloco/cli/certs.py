"""`diloco-certs`: a run's mutual-TLS credentials: its CA, the coordinator's certificate, one per
island (`init`, `island`, `coordinator`), revocation while the run goes on (`revoke`), and `show`."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from diloco.security import credentials as cr
from diloco.cli.common import ArgumentParser, fail

PROG = "diloco-certs"
_USAGE_NAMES = {ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth", ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth"}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    init = sub.add_parser("init", help="create a run's CA, the coordinator's certificate and the islands' in DIR")
    init.add_argument("dir", help="the credentials folder (created; holds the CA's key: keep it private)")
    init.add_argument("--hosts", required=True, type=_names,
                      help="every DNS name and IP address islands dial the coordinator at, comma-separated, "
                           "e.g. coord.example.com,10.0.0.5")
    init.add_argument("--islands", type=_names, default=[], help="island names, comma-separated, e.g. east,west")
    init.add_argument("--ranks", type=int, default=1,
                      help="the most ranks (replica groups x ranks per group) each of these islands may declare "
                           "(default %(default)s; issue an island of more with `island NAME --ranks N`)")
    init.add_argument("--run-name", default="diloco", help="named in the CA's subject (default %(default)s)")
    init.add_argument("--days", type=int, default=825, help="the certificates' validity (default %(default)s; the CA's: 3650)")
    isl = sub.add_parser("island", help="issue one more island's certificate from DIR's CA")
    isl.add_argument("dir")
    isl.add_argument("name", help="the island's name: its identity in the run")
    isl.add_argument("--ranks", type=int, default=1,
                     help="the most ranks (replica groups x ranks per group) the island may declare at join: "
                          "the coordinator refuses more (default %(default)s)")
    isl.add_argument("--days", type=int, default=825, help="validity (default %(default)s)")
    isl.add_argument("--force", action="store_true", help="replace an existing certificate for this name")
    coord = sub.add_parser("coordinator", help="re-issue the coordinator's certificate (new hosts, or expiry)")
    coord.add_argument("dir")
    coord.add_argument("--hosts", required=True, type=_names, help="every DNS name and IP address, comma-separated")
    coord.add_argument("--days", type=int, default=825, help="validity (default %(default)s)")
    rev = sub.add_parser("revoke", help="revoke an island by name; a running coordinator notices within a second")
    rev.add_argument("dir")
    rev.add_argument("name")
    rev.add_argument("--reason", default="", help="recorded with the revocation")
    show = sub.add_parser("show", help="print a certificate's subject, identity, SANs, validity and issuer")
    show.add_argument("file", help="a .pem certificate")
    return p


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one, comma-separated")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "init":
            return init(Path(args.dir), args.hosts, args.islands, args.run_name, args.days, args.ranks)
        if args.command == "island":
            files = cr.issue_island(args.dir, args.name, days=args.days, force=args.force, ranks=args.ranks)
            print(f"wrote {files.cert}, {files.key} (at most {args.ranks} ranks)")
            print(f"island {args.name} needs: {files.ca}, {files.cert}, {files.key}")
            return 0
        if args.command == "coordinator":
            files = cr.issue_coordinator(args.dir, args.hosts, days=args.days, force=True)
            print(f"wrote {files.cert}, {files.key} for {', '.join(args.hosts)}; restart the coordinator to use it")
            return 0
        if args.command == "revoke":
            new = cr.revoke(args.dir, args.name, args.reason)
            path = Path(args.dir) / cr.REVOKED
            print(f"revoked island {args.name} in {path}" if new else f"island {args.name} was already revoked in {path}")
            print(f"a coordinator that watches {path} refuses the island within a second")
            return 0
        return show(args.file)
    except cr.CredentialError as e:
        fail(PROG, str(e))


def init(d: Path, hosts: list[str], islands: list[str], run_name: str, days: int, ranks: int = 1) -> int:
    # Check every name before writing anything, so a typo leaves no half-made folder behind.
    for name in islands:
        cr.check_island_name(name)
    if len(set(islands)) != len(islands):
        raise cr.CredentialError(f"--islands {','.join(islands)}: a name appears twice")
    for host in hosts:
        cr.host_san(host)
    cr.check_days(days)
    cr.check_ranks(ranks)
    ca = cr.create_ca(d, run_name)
    coordinator = cr.issue_coordinator(d, hosts, days=days)
    island_files = [cr.issue_island(d, name, days=days, ranks=ranks) for name in islands]
    print(f"wrote {ca}, {d / cr.CA_KEY} (the CA: keep ca.key private, off the coordinator and islands)")
    print(f"wrote {coordinator.cert}, {coordinator.key} for {', '.join(hosts)}")
    for files in island_files:
        print(f"wrote {files.cert}, {files.key}")
    print("copy to each machine only what it needs:")
    print(f"  coordinator: {coordinator.ca}, {coordinator.cert}, {coordinator.key}")
    for name, files in zip(islands, island_files):
        print(f"  island {name}: {files.ca}, {files.cert}, {files.key}")
    if islands:
        print(f"each island may declare at most {ranks} rank(s); an island of more: {PROG} island {d} NAME --ranks N --force")
    print(f"more islands: {PROG} island {d} NAME [--ranks N]; revoke one: {PROG} revoke {d} NAME")
    return 0


def show(path: str) -> int:
    info = describe(cr.read_file(path), path)
    for key, value in info.items():
        print(f"{key + ':':12} {value}")
    return 0


def describe(cert_pem: bytes, source: str = "certificate") -> dict[str, object]:
    """Subject, identity (an island's name, or none), the ranks it may declare, SANs, usage, validity, issuer, serial."""
    cert = cr.load_cert(cert_pem, source)
    exts = {type(e.value): e.value for e in cert.extensions}
    san = exts.get(x509.SubjectAlternativeName)
    sans = [] if san is None else [*san.get_values_for_type(x509.DNSName),
                                   *map(str, san.get_values_for_type(x509.IPAddress)),
                                   *san.get_values_for_type(x509.UniformResourceIdentifier)]
    eku = exts.get(x509.ExtendedKeyUsage)
    usage = [] if eku is None else [_USAGE_NAMES.get(u, u.dotted_string) for u in eku]
    constraints = exts.get(x509.BasicConstraints)
    is_ca = constraints is not None and constraints.ca
    identity, ranks = None, "(not an island certificate)"
    if not is_ca and "clientAuth" in usage:
        try:
            identity = cr.identity_of(cert_pem)
        except cr.CredentialError:
            pass
        ranks = _ranks_line(cert_pem)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    validity = "valid now" if start <= now <= end else ("EXPIRED" if now > end else "NOT YET VALID")
    return {
        "subject": cert.subject.rfc4514_string(),
        "identity": f"island {identity}" if identity else "(none: not an island certificate)",
        "ranks": ranks,
        "usage": "certificate authority" if is_ca else ", ".join(usage) or "(none)",
        "sans": ", ".join(sans) or "(none)",
        "valid": f"{start:%Y-%m-%d %H:%M} to {end:%Y-%m-%d %H:%M} UTC ({validity})",
        "issuer": cert.issuer.rfc4514_string(),
        "serial": f"{cert.serial_number:x}",
    }


def _ranks_line(cert_pem: bytes) -> str:
    try:
        ranks = cr.ranks_of(cert_pem)
    except cr.CredentialError as e:
        return f"UNREADABLE ({e})"
    if ranks is None:
        return ("(not set: issued before the field; the coordinator refuses it at join unless "
                "rounds.allow_unranked_certificates: issue it again with --ranks N --force)")
    return f"at most {ranks}"


if __name__ == "__main__":
    raise SystemExit(main())
