"""diloco-island: joins a coordinator and trains until the run ends."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

# First: it quiets gRPC's C core (GRPC_VERBOSITY), which takes effect only before grpc is imported.
from diloco.cli.common import ArgumentParser, add_config_flags, fail, setup_logging  # isort: skip

from diloco.config import ConfigError, load_config
from diloco.security.credentials import TlsFiles, island_files
from diloco.security.net import is_loopback

# torch, gRPC, torchft and the island's own modules are imported once the arguments are checked (_join, and
# main's lock): `--help` and a bad flag answer in a fraction of a second instead of after seconds of imports.

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
    j.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (default 0: this machine's cores shared by the island ranks training on its CPU)")
    j.add_argument("--compile", action="store_true",
                   help="torch.compile the model (one-rank islands; worth it on a GPU, the first steps pay the compile)")
    j.add_argument("--connect-timeout", type=float, default=60.0, help="seconds to wait for the coordinator (default 60)")
    j.add_argument("--checkpoint", metavar="URL", default="", help="where to checkpoint this island (local path or s3://...)")
    j.add_argument("--checkpoint-every", type=int, default=5, metavar="N", help="checkpoint every N rounds (default 5)")
    j.add_argument("--resume", action="store_true", help="restore the newest checkpoint at --checkpoint and rejoin as the same island")
    j.add_argument("--max-rounds", type=int, default=None, help="leave after this many rounds (default: until the run ends)")
    j.add_argument("--steps-per-round", type=int, default=0, metavar="N",
                   help="this island's own H: N inner steps every round (default: the run's inner.steps_per_round; at most "
                        "inner.max_steps; streaming.fragments = 1)")
    j.add_argument("--throttle", type=float, default=0.0, metavar="S",
                   help="sleep S seconds in every inner step, as if on a slower device (tests, benchmarks)")
    j.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    j.add_argument("--tls", metavar="DIR", help="connect over mutual TLS with the run's CA (ca.pem) and this island's "
                   "certificate in DIR (island-NAME.pem/.key: `diloco-certs island`)")
    j.add_argument("--tls-name", metavar="NAME", help="which island certificate in --tls DIR (default: the only one there)")
    j.add_argument("--insecure", action="store_true", help="allow plaintext to a coordinator that is not on loopback")
    t = j.add_argument_group("telemetry", "What the island reports besides its heartbeats (islands/telemetry.py); rank 0 of "
                             "each replica group writes it.")
    t.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (replica group g: PORT + g; 0: any free port)")
    t.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address to serve metrics on (default 127.0.0.1)")
    t.add_argument("--log-url", default="", metavar="URL",
                   help="write JSON lines (per window of inner steps, per exchange) to this folder or s3://bucket/prefix")
    t.add_argument("--log-window", type=int, default=0, metavar="N", help="inner steps per window (default: a round's)")
    t.add_argument("--tensorboard", default="", metavar="DIR", help="write TensorBoard events under DIR (pip install tensorboard)")
    t.add_argument("--peak-tflops", type=float, default=None, metavar="TF",
                   help="the GPU's dense bf16 peak, for MFU (default: known for H100, H200, A100)")
    r = j.add_argument_group(
        "replica groups",
        "An island of R replica groups x N ranks: each group shards the model with FSDP2 (NCCL + bf16 on GPU, gloo + "
        "fp32 on CPU); torchft averages gradients across the groups every inner step and heals restarted groups. "
        "Started under torchrun or srun (RANK/WORLD_SIZE or SLURM_PROCID set), this process runs as that rank.",
    )
    r.add_argument("--nproc-per-node", type=int, default=1, metavar="N", help="FSDP ranks per replica group (default 1)")
    r.add_argument("--replica-groups", type=int, default=1, metavar="R", help="replica groups in this island (default 1)")
    r.add_argument("--max-restarts", type=int, default=3, metavar="M", help="times torchrun restarts a failed group (default 3)")
    r.add_argument("--lighthouse", default="", metavar="URL", help="an existing torchft lighthouse, http://HOST:PORT (default: start one)")
    r.add_argument("--island-key", default="", metavar="KEY", help="the key the groups join under (default: made up by the launcher)")
    r.add_argument("--ft-host", default="", metavar="HOST", help="address peers reach this machine at (default: hostname)")
    r.add_argument("--ft-timeout", type=float, default=300.0, metavar="S",
                   help="collective, commit and heal timeout; above one rank's push time (default 300)")
    r.add_argument("--ft-heartbeat-timeout", type=float, default=5.0, metavar="S",
                   help="a group silent this long leaves the quorum (lighthouse started here; default 5)")
    r.add_argument("--ft-startup-wait", type=float, default=60.0, metavar="S",
                   help="at start, wait this long for every replica group before training without some (default 60)")
    r.add_argument("--receive-window", type=int, default=0, metavar="BYTES",
                   help="fixed HTTP/2 receive window per stream (default: gRPC's adaptive one); bounds what the "
                        "transport buffers for a rank; throughput per stream is about window / RTT")
    r.add_argument("--report-dir", default="", metavar="DIR", help="write per-rank reports and final shards here")
    r.add_argument("--measure-memory", action="store_true", help="record each rank's peak memory growth in the outer step")
    return parser


def _telemetry_options(args):
    from islands.telemetry import TelemetryOptions
    return TelemetryOptions(args.metrics_port, args.metrics_host, args.log_url, args.tensorboard, args.log_window,
                            peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None)


def _launch_options(args):
    from islands.launch import LaunchOptions
    return LaunchOptions(
        args.nproc_per_node, args.replica_groups, args.max_restarts, args.lighthouse, args.island_key, args.ft_host,
        args.ft_heartbeat_timeout, args.device,
    )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if ":" not in args.coordinator:
        fail(parser.prog, f"--coordinator {args.coordinator!r} must be HOST:PORT")
    if args.resume and not args.checkpoint:
        fail(parser.prog, "--resume needs --checkpoint URL")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        fail(parser.prog, f"--metrics-port {args.metrics_port} is not a port (0..65535; 0: any free one)")
    if args.steps_per_round < 0 or args.throttle < 0:
        fail(parser.prog, "--steps-per-round and --throttle must be >= 0")
    if args.log_window < 0:
        fail(parser.prog, "--log-window must be at least 1 (or 0: a round's inner steps)")
    if args.tensorboard:
        from diloco.jsonlog import LogError, check_tensorboard
        try:
            check_tensorboard()
        except LogError as e:
            fail(parser.prog, str(e))
    tls = _tls_files(parser.prog, args)
    cfg = None
    if args.config or args.overrides:
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as e:
            fail(parser.prog, str(e))
    from islands.launch import LaunchError, claim_island, is_launched_rank
    try:
        launched = is_launched_rank()
        lock = claim_island(launched, args.checkpoint)  # a rank dies with its torchrun; one copy of an island per --checkpoint
    except LaunchError as e:
        fail(parser.prog, str(e))
    try:
        _join(parser, args, argv, cfg, tls, launched)
    finally:
        if lock is not None:
            lock.release()


def _join(parser: ArgumentParser, args, argv: list[str] | None, cfg, tls: TlsFiles | None, launched: bool) -> None:
    """The island's run once its arguments are checked and its lock is held: as a launcher, or as one rank."""
    import grpc
    import torch

    from diloco.checkpoint import CheckpointError
    from diloco.wire.refusal import Reason, reason_of
    from islands.client import CoordinatorUnreachable, LocalRefusal
    from islands.launch import LaunchError, launch, replica_spec, run_island
    from islands.outcome import REPLACED_EXIT
    from islands.world import IslandWorld

    sharded = (
        args.nproc_per_node > 1 or args.replica_groups > 1
        or int(os.environ.get("WORLD_SIZE", "1")) > 1 or int(os.environ.get("DILOCO_REPLICA_GROUPS", "1")) > 1
    )
    if sharded and args.compile:
        fail(parser.prog, "--compile is for one-rank islands for now; drop it for --nproc-per-node/--replica-groups islands")
    if args.threads < 0:
        fail(parser.prog, f"--threads {args.threads}: give a number of threads, or 0 for this rank's share of the cores")
    if args.threads:
        torch.set_num_threads(args.threads)
    if sharded and not launched:
        setup_logging(args.log_level, "island-launcher")
        argv = list(argv if argv is not None else sys.argv[1:])
        try:
            raise SystemExit(launch(argv, _launch_options(args)))
        except LaunchError as e:
            fail(parser.prog, str(e), e.status)
    try:
        spec = replica_spec(args)
    except LaunchError as e:
        fail(parser.prog, str(e))
    group = os.environ.get("DILOCO_REPLICA_GROUP", "0")
    setup_logging(args.log_level, f"island g{group} r{os.environ.get('RANK', '0')}" if launched else "island")
    if args.log_level != "debug":
        # torchft logs every quorum and commit; its warnings repeat a flight-recorder note at each quorum change.
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        world = IslandWorld.init(args.device)
    except ValueError as e:
        fail(parser.prog, str(e))
    try:
        result = run_island(
            args.coordinator, cfg, world, spec, args.max_rounds, args.connect_timeout,
            args.checkpoint, args.checkpoint_every, args.resume, args.compile, tls, _telemetry_options(args),
        )
        if result is None:  # the run had finished before we joined
            return
        log.info(
            "%s finished at round %d after %d rounds; parameters checksum %s (%s the coordinator's)",
            result.island_id, result.final_round, result.rounds, result.checksum,
            "matches" if result.checksum_matches else "differs from",
        )
    except CoordinatorUnreachable as e:
        _final(parser.prog, str(e), launched)
    except LocalRefusal as e:  # found on our side (the shards disagreeing), not the coordinator's refusal
        _final(parser.prog, e.details(), launched)
    except grpc.RpcError as e:
        message, status = ending(e)
        _final(parser.prog, message, launched, status)
    except (ConfigError, ValueError, CheckpointError, LaunchError) as e:
        _final(parser.prog, str(e), launched)
    except KeyboardInterrupt:
        pass
    finally:
        world.shutdown()
    if launched:
        # A rank's work is done and reported: skip the interpreter's teardown, where gloo's worker threads
        # can still hold tensors and abort the process ("terminate called without an active exception",
        # pytorch/pytorch#179291), which torchrun would report as a failed island.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def ending(e: grpc.RpcError) -> tuple[str, int]:
    """The one line and exit status of a run ended by a call that failed: the coordinator's refusal by its reason, or,
    where there is none, a transport that failed past the client's retries (not a refusal: it is worth retrying)."""
    from diloco.wire.refusal import Reason, reason_of  # here: grpc and protobuf load after argument checks
    from islands.outcome import REPLACED_EXIT

    reason = reason_of(e)
    if reason == Reason.REPLACED:  # another process joined as this island: the coordinator's words say so
        return e.details(), REPLACED_EXIT
    if reason == Reason.REASON_UNSPECIFIED:
        return (f"lost the coordinator ({e.code().name}: {e.details()}); once it is back, run the same command (with "
                "--resume where it has --checkpoint)", 1)
    return f"coordinator refused: {e.code().name}: {e.details()}", 2


def _final(prog: str, message: str, launched: bool, status: int = 2) -> NoReturn:
    """An error no restart mends: one line, for every island kind (a rank under our launcher has it print the line)."""
    if launched:
        from islands.launch import hand_to_launcher

        hand_to_launcher(message, status=status)
    fail(prog, message, status)


def _tls_files(prog: str, args) -> TlsFiles | None:
    """This island's certificate files (--tls DIR, --tls-name), or None for plaintext (loopback, or --insecure)."""
    host = args.coordinator.rsplit(":", 1)[0].strip("[]")
    if not args.tls:
        if args.tls_name:
            fail(prog, "--tls-name needs --tls DIR")
        if not is_loopback(host) and not args.insecure:
            fail(prog, f"the coordinator at {host} is not on this machine: connect with --tls DIR (the run's certificates, "
                       "`diloco-certs`), or --insecure on a network you trust")
        return None
    if args.insecure:
        fail(prog, "--tls and --insecure contradict each other; give one")
    name = args.tls_name
    if not name:
        found = sorted(p.name[len("island-"):-len(".pem")] for p in Path(args.tls).glob("island-*.pem"))
        if len(found) != 1:
            fail(prog, f"--tls {args.tls} holds {len(found)} island certificates ({', '.join(found) or 'none'}); "
                       "choose one with --tls-name")
        name = found[0]
    return island_files(args.tls, name)


if __name__ == "__main__":
    main()
