"""diloco-sim: a coordinator and N islands as processes on one machine, one line per round."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from diloco.cli.common import ArgumentParser, add_config_flags, config_from_args, fail
from islands.sim.wan import LinkSpec, WanSpecError, parse_wan

# torch, gRPC and the simulation are imported where they are needed (main): `--help` and a bad flag answer in a
# fraction of a second instead of after seconds of imports.


# 4-bit both ways, then zstd: +0.17% eval loss on tinyshakespeare for 8.9x fewer bytes (docs/benchmarks.md, Codec loss cost).
DEMO_WIRE = ["wire.codec=e3m0", "wire.zstd=true"]


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="diloco-sim",
        description="Simulate a multi-island DiLoCo run on one machine: a coordinator and N islands as processes over gRPC on 127.0.0.1.",
    )
    parser.add_argument("--islands", type=int, default=4, help="number of islands (default 4)")
    add_config_flags(parser)
    parser.add_argument("--rounds", type=int, help="override rounds.rounds")
    parser.add_argument("--workdir", help="where logs, the resolved config, the report and the coordinator's checkpoints "
                                          "(WORKDIR/ckpt/coordinator, for diloco-export) go (default: a temp dir)")
    parser.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                        help="do not checkpoint the coordinator (then there is no model to diloco-export)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--per-island", action="store_true", help="also print bytes up/down per island each round")
    parser.add_argument(
        "--wan", metavar="RATE:DELAY",
        help="give each island its own emulated link to the coordinator, e.g. 100mbit:80ms "
             "(rate in kbit/mbit/gbit per second, one-way delay in us/ms/s); "
             "a comma-separated list gives one link per island",
    )
    parser.add_argument(
        "--chaos", metavar="EVERY[:N]",
        help="SIGKILL a random island after every EVERY rounds and restart it with --resume; with :N also "
             "SIGKILL and restart the coordinator once after round N (checkpoints every round, in the workdir)",
    )
    parser.add_argument("--coordinator-shards", type=int, default=1, metavar="K", help="run the coordinator as K shard "
                        "processes, each holding 1/K of its state (docs/sharding.md; default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds (default 1800)")
    return parser


def _wan_text(wan: list[LinkSpec] | None) -> str:
    if not wan:
        return ""
    if len({(s.bits_per_s, s.delay_s) for s in wan}) == 1:
        return f", each island on its own emulated WAN link {wan[0]}"
    return f", emulated WAN links per island {', '.join(str(s) for s in wan)}"


def _codec_text(cfg) -> str:
    w = cfg.wire
    up = w.codec + ("+zstd" if w.zstd else "")
    down = (w.downlink_codec or w.codec) + ("+zstd" if w.zstd else "")
    return up if up == down else f"{up} up, {down} down"


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.islands < 1:
        fail(parser.prog, "--islands must be at least 1")
    if args.coordinator_shards < 1:
        fail(parser.prog, "--coordinator-shards must be at least 1")
    if args.coordinator_shards > 1 and (args.wan is not None or args.chaos is not None):
        fail(parser.prog, "--coordinator-shards does not combine with --wan or --chaos yet; run one or the other")
    if args.rounds is not None:
        args.overrides.append(f"rounds.rounds={args.rounds}")
    # Every island starts in round 0 and owns its own shard of the data; one island alone takes the first outer step
    # without a second to judge it against (robust.first_quorum).
    args.overrides = [f"rounds.min_islands={args.islands}", f"data.shards={args.islands}",
                      f"robust.first_quorum={min(2, args.islands)}"] + args.overrides
    if args.config is None:  # the demo runs the codec the README recommends (a --set wire.* still wins)
        args.overrides = DEMO_WIRE + args.overrides
    chaos_plan = None
    if args.chaos is not None:
        from islands.sim.chaos import parse_chaos
        try:
            chaos_plan = parse_chaos(args.chaos)
        except ValueError as e:
            fail(parser.prog, f"--chaos: {e}")
        if args.wan is not None:
            fail(parser.prog, "--chaos and --wan do not combine yet; run one or the other")
        if not args.checkpoint:
            fail(parser.prog, "--chaos resumes from checkpoints; drop --no-checkpoint")
        args.overrides = ["checkpoint.every_rounds=1"] + args.overrides
    cfg = config_from_args(parser.prog, args)
    wan = None
    if args.wan is not None:
        try:
            wan = parse_wan(args.wan, args.islands)
        except WanSpecError as e:
            fail(parser.prog, f"--wan: {e}")
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="diloco-sim-"))
    s = cfg.streaming
    streaming = (f", streaming: {s.fragments} fragments ({s.pattern}), tau={s.overlap}, alpha={s.alpha:g}"
                 f"{', eager' if s.eager else ''}") if s.fragments > 1 or s.overlap or s.eager else ""
    shards = f", the coordinator in {args.coordinator_shards} shards" if args.coordinator_shards > 1 else ""
    print(f"diloco-sim: {args.islands} islands, {cfg.rounds.rounds} rounds of H={cfg.inner.steps_per_round}, "
          f"config {cfg.name!r}, codec {_codec_text(cfg)}{streaming}{_wan_text(wan)}{shards} (logs in {workdir})", flush=True)
    echo = lambda s: print(s, flush=True)  # noqa: E731
    import grpc

    from islands.sim.chaos import describe, run_chaos
    from islands.sim.simulation import run_sim, summarize

    try:
        if chaos_plan is not None:
            result, chaos = run_chaos(cfg, args.islands, workdir, chaos_plan, args.timeout, echo, args.threads, args.per_island)
            echo(describe(chaos))
        else:
            result = run_sim(cfg, args.islands, workdir, args.timeout, args.threads, echo=echo, per_island=args.per_island, wan=wan,
                             coordinator_shards=args.coordinator_shards, checkpoint=args.checkpoint)
    except (RuntimeError, TimeoutError, grpc.RpcError) as e:
        fail(parser.prog, f"simulation failed: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130)
    summarize(result, cfg)


if __name__ == "__main__":
    main()
