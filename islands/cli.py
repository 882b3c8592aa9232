"""diloco-island: joins a coordinator and trains until the run ends."""

from __future__ import annotations

import logging

import grpc
import torch

from diloco.checkpoint import CheckpointError
from diloco.cli import ArgumentParser, add_config_flags, fail, setup_logging
from diloco.config import ConfigError, load_config
from islands.client import CoordinatorUnreachable
from islands.trainer import join_and_run
from islands.world import IslandWorld

log = logging.getLogger("islands")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="diloco-island",
        description="Runs one DiLoCo island: H local steps per round, then a pseudo-gradient exchange with the coordinator.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    j = sub.add_parser("join", help="join a coordinator and train", description="Join a coordinator and train until the run ends.")
    j.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="address of `diloco-coordinator serve`")
    add_config_flags(j)
    j.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when available)")
    j.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    j.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator (default 60)")
    j.add_argument("--checkpoint", metavar="URL", default="", help="where to checkpoint this island (local path or s3://...)")
    j.add_argument("--checkpoint-every", type=int, default=5, metavar="N", help="checkpoint every N rounds (default 5)")
    j.add_argument("--resume", action="store_true", help="restore the newest checkpoint at --checkpoint and rejoin as the same island")
    j.add_argument("--max-rounds", type=int, default=None, help="leave after this many rounds (default: until the run ends)")
    j.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if ":" not in args.coordinator:
        fail(parser.prog, f"--coordinator {args.coordinator!r} must be HOST:PORT")
    if args.resume and not args.checkpoint:
        fail(parser.prog, "--resume needs --checkpoint URL")
    cfg = None
    if args.config or args.overrides:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            fail(parser.prog, str(e))
    setup_logging(args.log_level, "island")
    if args.threads:
        torch.set_num_threads(args.threads)
    world = IslandWorld.init(args.device)
    try:
        result = join_and_run(
            args.coordinator, cfg, world, args.max_rounds, args.connect_timeout,
            args.checkpoint, args.checkpoint_every, args.resume,
        )
        log.info(
            "%s finished at round %d after %d rounds; parameters checksum %s (%s the coordinator's)",
            result.island_id, result.final_round, result.rounds, result.checksum,
            "matches" if result.checksum_matches else "differs from",
        )
    except CoordinatorUnreachable as e:
        fail(parser.prog, str(e))
    except grpc.RpcError as e:
        fail(parser.prog, f"coordinator refused: {e.code().name}: {e.details()}")
    except (ConfigError, ValueError, CheckpointError) as e:
        fail(parser.prog, str(e))
    except KeyboardInterrupt:
        pass
    finally:
        world.shutdown()


if __name__ == "__main__":
    main()
