"""diloco-coordinator: serves the global parameters and the outer optimizer."""

from __future__ import annotations

import json

import torch

from coordinator.server import serve
from diloco.cli import ArgumentParser, add_config_flags, config_from_args, fail, setup_logging


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
    s.add_argument("--port-file", metavar="PATH", help="write the bound port here once serving (useful with --port 0)")
    s.add_argument("--report", metavar="PATH", help="write a JSON report of every round here when the run ends")
    s.add_argument("--resume", action="store_true", help="restore the newest committed checkpoint at checkpoint.url")
    s.add_argument("--checkpoint", metavar="URL", help="checkpoint location (local path or s3://...); sets checkpoint.url")
    s.add_argument("--linger", type=float, default=30.0, help="seconds to wait for islands to leave after the last round (default 30)")
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.checkpoint:
        args.overrides.append(f"checkpoint.url={json.dumps(args.checkpoint)}")
    cfg = config_from_args(parser.prog, args)
    if not 0 <= args.port < 65536:
        fail(parser.prog, f"--port {args.port} is not a valid port")
    setup_logging(args.log_level, "coordinator")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        serve(cfg, args.host, args.port, args.report, args.linger, args.port_file, args.resume)
    except (OSError, ValueError) as e:
        fail(parser.prog, str(e))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
