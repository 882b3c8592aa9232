"""diloco-coordinator: serves the global parameters and the outer optimizer."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

# First: it quiets gRPC's C core (GRPC_VERBOSITY), which takes effect only before grpc is imported.
from diloco.cli.common import ArgumentParser, add_config_flags, config_from_args, fail, setup_logging  # isort: skip

from diloco.security.credentials import RevocationList, coordinator_files
from coordinator.rollback import ROLL_BACK_EXIT, RolledBack

# torch, gRPC and the server are imported once the arguments are checked (main): `--help` and a bad flag answer
# in a fraction of a second instead of after seconds of imports.


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="diloco-coordinator",
        description="Owns the global parameters and the outer optimizer of a DiLoCo run; islands join it over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    s = sub.add_parser("serve", help="serve a run until it finishes", description="Serve a DiLoCo run until its last round closes.")
    add_config_flags(s)
    s.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0; use 127.0.0.1 for one machine)")
    s.add_argument("--port", type=int, default=50051, help="port to bind (default 50051; 0 picks a free one)")
    s.add_argument("--port-file", metavar="PATH", help="write the bound port here once serving (useful with --port 0); with --shards K the leading "
                   "shard's, once every shard serves, and every shard's address in PATH.shards")
    s.add_argument("--report", metavar="PATH", help="write a JSON report of every round here when the run ends; "
                   "--shards K alone (K local shards): the run's here, each shard's part at PATH.shard-I")
    s.add_argument("--resume", action="store_true", help="restore the newest committed checkpoint at checkpoint.url")
    s.add_argument("--checkpoint", metavar="URL", help="checkpoint location (local path or s3://...); sets checkpoint.url")
    s.add_argument("--linger", type=float, default=30.0, help="seconds to wait for islands to leave after the last round (default 30)")
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    s.add_argument("--tls", metavar="DIR", help="serve mutual TLS with the run's certificates in DIR (ca.pem, coordinator.pem, "
                   "coordinator.key: `diloco-certs init`); islands are who their certificates say")
    s.add_argument("--revoked", metavar="FILE", help="revoked island names (default DIR/revoked.json with --tls: "
                   "`diloco-certs revoke`), re-read while the run goes on")
    s.add_argument("--audit", metavar="URL", default="", help="write the audit log (joins, pushes, refusals with their "
                   "reasons, revocations, leaves) as JSON lines here (a local folder or s3://...)")
    s.add_argument("--http-port", type=int, default=8470, help="the live dashboard (/) and Prometheus metrics (/metrics) on "
                   "this port (default 8470; 0 picks a free one, -1 turns it off)")
    s.add_argument("--http-host", default="127.0.0.1", help="address the dashboard binds (default 127.0.0.1: it has no "
                   "authentication; put a proxy that authenticates in front before exposing it)")
    s.add_argument("--http-port-file", metavar="PATH", help="write the dashboard's port here once serving")
    s.add_argument("--log-url", metavar="URL", default="", help="write one JSON line per round here (a local folder or s3://...)")
    s.add_argument("--tensorboard", metavar="DIR", default="", help="write TensorBoard events here (needs `pip install tensorboard`)")
    s.add_argument("--insecure", action="store_true", help="allow plaintext on an address other than loopback (a warning is logged)")
    s.add_argument("--shards", type=int, default=0, metavar="K", help="split the coordinator's state across K shard "
                   "processes (docs/sharding.md); alone, starts all K here on --port .. --port+K-1")
    s.add_argument("--shard", type=int, default=None, metavar="I", help="serve only shard I of --shards K (default: from "
                   "torchrun's RANK, SLURM_PROCID or a StatefulSet pod's ordinal); needs --shard-addresses and "
                   "DILOCO_SHARD_SECRET")
    s.add_argument("--shard-addresses", default="", metavar="A0,A1,..", help="every shard's host:port as islands reach it, "
                   "in shard order (the leading shard's first)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def shard_place(prog: str, args) -> tuple[int, int] | None:
    """(index, count) of the shard this process serves; None for an unsharded coordinator or the local launcher."""
    from coordinator.launch import launcher_index

    addresses = [a for a in args.shard_addresses.split(",") if a]
    if args.shard is not None:
        place = (args.shard, args.shards)
    elif addresses:
        place = launcher_index()
        if place is None:
            fail(prog, "--shard-addresses without --shard: give --shard I, or run under torchrun, SLURM or a StatefulSet")
        place = (place[0], place[1] or args.shards)
    else:
        if args.shards < 0:
            fail(prog, f"--shards {args.shards}: give 1 or more")
        return None
    index, count = place
    count = count or len(addresses)
    if not addresses or len(addresses) != count:
        fail(prog, f"shard {index} of {count} needs --shard-addresses with {count} host:port entries, got {len(addresses)}")
    if not 0 <= index < count:
        fail(prog, f"shard {index} does not exist in a coordinator of {count} shards")
    return index, count


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint:
        args.overrides.append(f"checkpoint.url={json.dumps(args.checkpoint)}")
    cfg = config_from_args(parser.prog, args)
    if not 0 <= args.port < 65536:
        fail(parser.prog, f"--port {args.port} is not a valid port")
    if args.tls and args.insecure:
        fail(parser.prog, "--tls and --insecure contradict each other; give one")
    if not -1 <= args.http_port < 65536:
        fail(parser.prog, f"--http-port {args.http_port} is not a valid port (-1 turns the dashboard off)")
    if args.revoked and not args.tls:
        fail(parser.prog, "--revoked needs --tls: revocation applies to certificates")
    place = shard_place(parser.prog, args)
    # Each shard's lines say whose they are: `serve --shards K` prints every shard's output in one stream.
    setup_logging(args.log_level, "coordinator" if place is None else f"coordinator shard {place[0]}")
    if place is None and args.shards > 1:
        from coordinator.launch import launch_local_shards

        raise SystemExit(launch_local_shards(argv if argv is not None else sys.argv[1:], args))
    import torch

    from coordinator.server import Observe, raise_open_file_limit, serve

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        tls = coordinator_files(args.tls) if args.tls else None
        revocations = RevocationList(args.revoked or Path(args.tls) / "revoked.json") if args.tls else None
        observe = Observe(args.http_host, None if args.http_port < 0 else args.http_port, args.log_url, args.tensorboard)
        shard = None
        if place is not None:
            from coordinator.launch import shard_secret
            from coordinator.sharding import ShardRole

            shard = ShardRole(place[0], tuple(args.shard_addresses.split(",")), shard_secret())
        raise_open_file_limit()  # each island's connection and spooled push takes a file
        stop_on_sigterm()
        serve(cfg, args.host, args.port, args.report, args.linger, args.port_file, args.resume, tls, args.insecure, revocations,
              args.audit, observe, args.http_port_file, shard)
    except (OSError, ValueError) as e:
        fail(parser.prog, str(e))
    except KeyboardInterrupt:
        pass
    except RolledBack:  # logged where decided; the launcher starts this shard again with --resume
        raise SystemExit(ROLL_BACK_EXIT)


def stop_on_sigterm() -> None:
    """SIGTERM (Kubernetes, systemd, SLURM at a job's end, `serve --shards K` passing its own on) stops the coordinator
    as Ctrl-C does: the server stops, the report is written and the spool directory it made is removed. A second one
    while it stops is ignored (SIGKILL still ends it)."""

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


if __name__ == "__main__":
    main()
