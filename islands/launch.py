"""Starting a sharded island: as one rank of a launch, or as the launcher of its R x N ranks.

`diloco-island join --nproc-per-node N --replica-groups R` starts a torchft
lighthouse (unless --lighthouse names one) and, per replica group g, one
`torch.distributed.run --standalone --nproc-per-node N --max-restarts M`
(torchrun's semantics: the group's own rendezvous and store; a dead rank makes
torchrun restart the whole group, which then heals from a live group). Each
rank is started with

    DILOCO_REPLICA_GROUP=g   DILOCO_REPLICA_GROUPS=R   DILOCO_ISLAND_KEY=...
    TORCHFT_LIGHTHOUSE=http://HOST:PORT   DILOCO_FT_HOST=HOST

and with torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
Started that way by anything else (your own torchrun, one srun step per
replica group under SLURM), the same command runs as that rank.

The launcher is the island: on Linux its torchruns, and their ranks, die with it
however it dies (SIGKILL included; see `die_with_parent`), and while it runs it
holds the lock of its --checkpoint (`IslandLock`), so that a second copy started
beside it (a `--resume` of the same island) is refused instead of training as
that island twice. A one-rank island holds the same lock.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from diloco.config import RunConfig
from diloco.cli.lifetime import child_dies_with, set_parent_death_signal
from diloco.security.credentials import TlsFiles
from islands.client import CoordinatorClient
from islands.sharded import ShardedClient
from islands.joining import join_run
from islands.replicas import FT_HOST_ENV, LIGHTHOUSE_ENV, FtConfig, start_lighthouse
from islands.checkpoint import IslandCheckpoint
from islands.cores import CoreShare
from islands.island import Island, IslandResult
from islands.state import ReplicaSpec
from islands.telemetry import IslandTelemetry, TelemetryOptions
from islands.world import IslandWorld

log = logging.getLogger(__name__)

GROUP_ENV, GROUPS_ENV, KEY_ENV = "DILOCO_REPLICA_GROUP", "DILOCO_REPLICA_GROUPS", "DILOCO_ISLAND_KEY"
INSTANCE_ENV = "DILOCO_ISLAND_INSTANCE"  # set by the launcher: the token every rank of this island process names
LAUNCHER_ENV = "DILOCO_LAUNCHER_PID"  # set by the launcher for its torchruns' ranks
FINAL_ENV = "DILOCO_FINAL_ERROR"  # a file the launcher names to its ranks: an error of theirs that no restart mends
_FINAL_WAIT_S = 120.0  # how long a rank that handed its error over waits for the launcher to stop it
LOCK_NAME = "island.lock"


class LaunchError(ValueError):
    """A launch that cannot work; the message says what to set. status: the exit status it ends the launch with."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


def adopt_slurm_env(env: dict[str, str] = os.environ) -> bool:
    """Under srun (one step per replica group), maps SLURM's task ids onto torchrun's variables.

    Returns True when this process is one rank of a launched world.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return True
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise LaunchError(
            f"running under SLURM with {env['SLURM_NTASKS']} tasks but {', '.join(missing)} unset: export MASTER_ADDR "
            "(the first node of this srun step) and MASTER_PORT (free, distinct per replica group) before srun"
        )
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault(KEY_ENV, f"slurm-{env.get('SLURM_JOB_ID', 'job')}")
    return True


def is_launched_rank(env: dict[str, str] = os.environ) -> bool:
    return adopt_slurm_env(env)


# --- an island's processes die with its launcher ------------------------------------------------
#
# A parent-death signal in every process (diloco/cli/lifetime.py says why): the launcher's death kills its torchruns, a
# torchrun's death kills its ranks. Both torchrun and torch's agent start their children from the main thread, whose
# exit is what the signal follows.


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def die_with_parent(env: dict[str, str] = os.environ) -> None:
    """In a rank started by torchrun: SIGKILL when torchrun dies (SIGKILL of torchrun, or of our launcher).

    The signal is set here, seconds after the fork (torch's imports): if torchrun died meanwhile this rank
    was already handed to another parent and would never get it. Under our launcher the rank checks that
    its parent's parent is still the launcher (torchrun alive and not orphaned) and else exits at once. Under
    a torchrun of your own there is no such pid to check; an orphan there cannot reach torchrun's store and
    fails in its rendezvous. Under srun (no torchrun) nothing is set: slurmstepd owns the ranks.
    """
    if "TORCHELASTIC_RUN_ID" not in env or not set_parent_death_signal():
        return
    launcher = env.get(LAUNCHER_ENV, "")
    parent = os.getppid()
    if launcher.isdigit() and _parent_of(parent) != int(launcher):
        sys.stderr.write(f"diloco-island: rank {env.get('RANK', '?')}: its torchrun or launcher is gone; exiting\n")
        sys.stderr.flush()
        os._exit(1)


# --- an error no restart mends ends the launch in one line --------------------------------------------
#
# torchrun restarts a group whose rank exits non-zero (--max-restarts times), then prints the rank's traceback: a
# refusal at join, or a bad config, would be met 1 + max_restarts times and end in ~40 lines. A rank under our
# launcher hands such an error to it instead and waits; the launcher stops every group and prints the error as its
# own one line, as a one-rank island does.


def hand_to_launcher(message: str, env: dict[str, str] = os.environ, status: int = 2) -> None:
    """In a rank under our launcher: gives it `message` and the exit status to end with (the first rank's win) and
    waits to be stopped. Returns at once without a launcher, and after _FINAL_WAIT_S if the launcher never stops us
    (the caller then fails as usual)."""
    path = env.get(FINAL_ENV, "")
    if not path:
        return
    staged = f"{path}.{os.getpid()}"
    try:
        Path(staged).write_text(f"{status}\n{message}")
        os.link(staged, path)  # whole or not at all; an existing file is another rank's error, told first
    except OSError:
        pass
    finally:
        Path(staged).unlink(missing_ok=True)
    time.sleep(_FINAL_WAIT_S)


def _wait_for_groups(procs: list[subprocess.Popen], final: Path) -> list[int]:
    """Every group's exit status; raises LaunchError with a rank's handed-over error as soon as there is one."""
    while True:
        if final.exists():
            status, _, message = final.read_text().strip().partition("\n")
            raise LaunchError(message.strip(), int(status) if status.isdigit() else 2)
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        time.sleep(0.1)


# --- one copy of an island -----------------------------------------------------------------------


class IslandLock:
    """An exclusive flock held while this island runs; the kernel drops it when the holder dies.

    Keyed by --checkpoint, the island's identity on disk: two copies writing one checkpoint, or a
    --resume beside the copy it resumes, would train as one island twice. A local checkpoint folder
    holds the lock file itself (island.lock; on NFS Linux maps flock to an NFS lock, so it holds across
    machines there). A remote URL (s3://...) cannot hold a lock: the lock is then a local file named by
    the URL's hash under the user's runtime folder, which refuses a second copy on this machine only;
    one started on another machine is not seen.
    """

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @staticmethod
    def path_for(checkpoint: str) -> str:
        from fsspec.core import split_protocol

        url = checkpoint.rstrip("/")
        protocol, root = split_protocol(url)
        if protocol in (None, "file", "local"):
            os.makedirs(root, exist_ok=True)
            return os.path.abspath(os.path.join(root, LOCK_NAME))
        runtime = os.environ.get("XDG_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"diloco-{os.getuid()}")
        folder = os.path.join(runtime, "diloco-islands")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.path.join(folder, hashlib.sha256(url.encode()).hexdigest()[:24] + ".lock")

    @classmethod
    def acquire(cls, checkpoint: str) -> "IslandLock":
        """Takes the lock, or raises LaunchError naming the copy that holds it."""
        try:
            path = cls.path_for(checkpoint)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except (OSError, ValueError) as e:
            raise LaunchError(f"--checkpoint {checkpoint}: cannot create this island's lock file: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise LaunchError(f"--checkpoint {checkpoint}: cannot lock {path}: {e}") from e
            who = f"pid {holder}" if holder else "pid unknown"
            raise LaunchError(
                f"another copy of this island is running ({who}, holding {path}); it would train as the same island "
                f"twice: stop that copy first (its ranks exit with it), or give this one its own --checkpoint"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = -1


def claim_island(launched: bool, checkpoint: str) -> IslandLock | None:
    """At the start of `diloco-island join`: a rank started by torchrun dies with it; a launcher or a one-rank
    island takes the lock of its --checkpoint (none without one), which the caller releases when it ends. Raises
    LaunchError if another copy holds it."""
    if launched:
        die_with_parent()
        return None
    if not checkpoint:
        return None
    return IslandLock.acquire(checkpoint)


@dataclass
class LaunchOptions:
    nproc_per_node: int = 1
    replica_groups: int = 1
    max_restarts: int = 3
    lighthouse: str = ""
    island_key: str = ""
    ft_host: str = ""
    heartbeat_timeout_s: float = 5.0
    device: str = "auto"  # cpu, cuda or auto: decides whether the groups are given GPUs


def gpu_placement(opts: LaunchOptions, env: dict[str, str], device_count: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each replica group started on this node, or None on CPU.

    torchrun gives a group's ranks LOCAL_RANK 0..N-1 and each rank takes cuda:LOCAL_RANK, so
    without this every group would land on the same N GPUs, and NCCL refuses two ranks of one
    communicator (torchft's cross-group one included) on one GPU. Group g gets GPUs
    [g*N, (g+1)*N) of those visible here.
    """
    cuda = opts.device.startswith("cuda") or (opts.device == "auto" and device_count > 0)
    if not cuda:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    listed = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else [str(i) for i in range(device_count)]
    gpus = listed[:device_count]  # entries CUDA could not open are not GPUs
    need = opts.replica_groups * opts.nproc_per_node
    if need > len(gpus):
        raise LaunchError(
            f"--replica-groups {opts.replica_groups} x --nproc-per-node {opts.nproc_per_node} needs {need} GPUs on this node, "
            f"but {len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible (NCCL cannot put two ranks on one GPU): lower them, "
            "start the replica groups on separate nodes (one torchrun or srun step each, sharing --lighthouse), or use --device cpu"
        )
    n = opts.nproc_per_node
    return [",".join(gpus[g * n:(g + 1) * n]) for g in range(opts.replica_groups)]


def worker_command(worker_argv: list[str], opts: LaunchOptions) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
        f"--nproc-per-node={opts.nproc_per_node}", f"--max-restarts={opts.max_restarts}", "--monitor-interval=0.5",
        "-m", "islands", *worker_argv,
    ]


def launch(worker_argv: list[str], opts: LaunchOptions) -> int:
    """Runs the island's replica groups to the end; returns the worst exit status."""
    if opts.nproc_per_node < 1 or opts.replica_groups < 1:
        raise LaunchError("--nproc-per-node and --replica-groups must be at least 1")
    host = opts.ft_host or os.environ.get(FT_HOST_ENV) or socket.gethostname()
    placement = gpu_placement(opts, dict(os.environ), torch.cuda.device_count())
    preexec = child_dies_with(os.getpid())
    key = opts.island_key or os.environ.get(KEY_ENV) or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    instance = os.environ.get(INSTANCE_ENV) or uuid.uuid4().hex  # one for all its groups, kept by their restarts
    lighthouse, server = opts.lighthouse or os.environ.get(LIGHTHOUSE_ENV, ""), None
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    if opts.replica_groups > 1 and not lighthouse:
        server, lighthouse = start_lighthouse(host, heartbeat_timeout_ms=int(opts.heartbeat_timeout_s * 1000))
    procs: list[subprocess.Popen] = []
    codes: list[int] = []
    scratch = Path(tempfile.mkdtemp(prefix="diloco-launch-"))
    final = scratch / "final-error"

    def stop(signum, _frame) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for g in range(opts.replica_groups):
            env = dict(os.environ, **{GROUP_ENV: str(g), GROUPS_ENV: str(opts.replica_groups), KEY_ENV: key, FT_HOST_ENV: host,
                                      LAUNCHER_ENV: str(os.getpid()), FINAL_ENV: str(final), INSTANCE_ENV: instance})
            if lighthouse:
                env[LIGHTHOUSE_ENV] = lighthouse
            if placement is not None:
                env["CUDA_VISIBLE_DEVICES"] = placement[g]
            procs.append(subprocess.Popen(worker_command(worker_argv, opts), env=env, start_new_session=True, preexec_fn=preexec))
        log.info("island %s: %d replica group(s) x %d rank(s) started (lighthouse %s)", key, opts.replica_groups, opts.nproc_per_node, lighthouse or "-")
        codes = _wait_for_groups(procs, final)
    finally:
        # After a handed-over error, quietly: the ranks die with their torchrun (die_with_parent), which on SIGTERM
        # would log its shutdown over the one line.
        stop(signal.SIGKILL if final.exists() else signal.SIGTERM, None)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                stop(signal.SIGKILL, None)
        for s, handler in old.items():
            signal.signal(s, handler)
        if server is not None:
            server.shutdown()
        for leftover in scratch.iterdir():
            leftover.unlink()
        scratch.rmdir()
    for g, code in enumerate(codes):
        if code:
            log.error("replica group %d exited with status %d", g, code)
    return max(codes, default=0)


def replica_spec(args, env: dict[str, str] = os.environ) -> ReplicaSpec:
    """This rank's place in the island, from the launch environment and the command line."""
    groups = int(env.get(GROUPS_ENV, args.replica_groups))
    group = int(env.get(GROUP_ENV, "0"))
    if not 0 <= group < groups:
        raise LaunchError(f"{GROUP_ENV}={group} is outside 0..{groups - 1} (--replica-groups {groups})")
    lighthouse = args.lighthouse or env.get(LIGHTHOUSE_ENV, "")
    if groups > 1 and not lighthouse:
        raise LaunchError(
            f"{groups} replica groups need a torchft lighthouse: pass --lighthouse http://HOST:PORT or set {LIGHTHOUSE_ENV} "
            "(run `diloco-island join --replica-groups R` without torchrun and it starts one)"
        )
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    key = args.island_key or env.get(KEY_ENV) or (lighthouse and f"lighthouse-{lighthouse}") or (run_id and f"torchrun-{run_id}")
    ft = FtConfig(
        lighthouse=lighthouse, host=args.ft_host or env.get(FT_HOST_ENV, ""), timeout_s=args.ft_timeout,
        startup_wait_s=args.ft_startup_wait,
    )
    return ReplicaSpec(group, groups, key or "", ft, args.report_dir or "", args.measure_memory, args.receive_window,
                       steps_per_round=getattr(args, "steps_per_round", 0), throttle_s=getattr(args, "throttle", 0.0),
                       cpu_threads=getattr(args, "threads", 0))


def process_instance(spec: ReplicaSpec, world: IslandWorld, env: dict[str, str] = os.environ) -> str:
    """The token that names this island process in every call (diloco/wire/messages.py INSTANCE_KEY): a join naming
    another token than the island's replaces the process it was, whose calls are then refused REPLACED. Every rank
    and replica group of one island process names the same one: the launcher's (INSTANCE_ENV, kept through a
    group's restarts); without it, replica groups started otherwise (srun, a torchrun of your own) derive theirs from
    the key they share, and one group's ranks take their rank 0's, drawn at start."""
    if env.get(INSTANCE_ENV):
        return env[INSTANCE_ENV]
    if spec.groups > 1 and spec.key:
        return hashlib.sha256(f"diloco-instance:{spec.key}".encode()).hexdigest()[:32]
    return world.broadcast_object(uuid.uuid4().hex if world.is_leader else None)


def run_island(
    address: str, cfg: RunConfig | None, world: IslandWorld, spec: ReplicaSpec, max_rounds: int | None = None,
    connect_timeout_s: float = 60.0, checkpoint_url: str = "", checkpoint_every: int = 1, resume: bool = False,
    compile_model: bool = False, tls: TlsFiles | None = None, telemetry: TelemetryOptions | None = None,
) -> IslandResult | None:
    """One rank of an island, of any kind: rank 0 of the group joins (under the island key), every rank trains
    and exchanges its own shard over its own connection. None if the run had already finished.

    With checkpoint_url the island checkpoints every checkpoint_every rounds (islands/checkpoint.py); with
    resume every group first loads the coordinator's step's checkpoint (else the newest) and rejoins as the
    same island.

    telemetry: what the island writes (islands/telemetry.py); rank 0 of each replica group writes it, metrics on
    port metrics_port + group, so that the groups of one node do not collide."""
    if resume and not checkpoint_url:
        raise ValueError("--resume needs --checkpoint URL")
    ckpt = IslandCheckpoint(checkpoint_url, checkpoint_every, world) if checkpoint_url else None
    previous = ckpt.choose() if ckpt is not None and resume else None
    instance = process_instance(spec, world)
    island_telemetry = IslandTelemetry(telemetry, world.is_leader, spec.group, spec.groups)
    cores = None

    def connect(address: str) -> CoordinatorClient:
        return CoordinatorClient(address, connect_timeout_s, receive_window_bytes=spec.receive_window_bytes, tls=tls,
                                 instance=instance)

    try:
        # A sharded coordinator's leader names the other shards at join (islands/sharded.py); else this is the one.
        client = ShardedClient(connect(address), connect)
    except BaseException:
        island_telemetry.close()
        raise
    client.progress = world.is_leader and spec.group == 0  # one progress line per island on a shared terminal
    try:
        joined = join_run(client, world, cfg, previous[1]["island_id"] if previous else "", spec.key, spec.groups)
        if joined is None:
            return None
        joined, run_cfg = joined
        if world.device.type == "cpu" and not spec.cpu_threads:  # joined: a share of the cores for the training
            cores = CoreShare()
            cores.apply()
        client.adopt(joined)  # the ranks that did not join connect to the other shards too
        torch.manual_seed(run_cfg.seed + 1000 * world.rank)
        island = Island(run_cfg, world, client, joined, spec, compile_model)
        island.telemetry = island_telemetry
        if world.is_leader:
            client.start_heartbeat(lambda: island.island_id, joined.heartbeat_interval_s, lambda: island.round,
                                   island_telemetry.heartbeat_report)
        if previous is not None:
            ckpt.restore(island.ctx, prefer_step=sum(joined.fragment_rounds) if joined.fragment_rounds else joined.round)
        island.checkpoint = ckpt
        island.ctx.cores = cores
        return island.run(max_rounds)
    finally:
        client.close()
        island_telemetry.close()
        if cores is not None:
            cores.close()
