"""Shared command-line plumbing: one-line errors with exit status 2, logging, config flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import NoReturn

from diloco.config import ConfigError, RunConfig, load_config

# gRPC's C core logs to stderr on its own, past Python's logging: every failed TLS handshake, at INFO, on each of
# its retries. It reads GRPC_VERBOSITY once, when grpc is first imported, so this is set here, on importing the
# shared command-line plumbing, which the console scripts import before grpc. Errors still show; a
# GRPC_VERBOSITY of the user's own (INFO, DEBUG) wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

# Libraries that log at INFO what nobody asked ("Found credentials in environment variables." on every S3
# command, a connection pool's retries): quiet below WARNING unless --log-level debug.
_CHATTY_LIBRARIES = ("botocore", "boto3", "aiobotocore", "s3fs", "s3transfer", "fsspec", "urllib3")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag on one line (not usage plus error) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: str, status: int = 2) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(status)


def add_config_flags(parser: argparse.ArgumentParser, required: bool = False) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        required=required,
        help="run config (TOML), e.g. configs/tiny.toml; default: the embedded tiny demo config",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set inner.lr=1e-3 (repeatable)",
    )


def config_from_args(prog: str, args: argparse.Namespace) -> RunConfig:
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        fail(prog, str(e))


def setup_logging(level: str, name: str = "") -> None:
    prefix = f"[{name}] " if name else ""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if level.lower() != "debug":
        quiet = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
        for library in _CHATTY_LIBRARIES:
            logging.getLogger(library).setLevel(quiet)
