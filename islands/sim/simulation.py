"""A coordinator and N islands as separate processes on one machine, over gRPC on 127.0.0.1.

What `diloco-sim` and the tests run. It only launches `python -m coordinator`
and `python -m islands` and watches the coordinator over the public protocol,
so it exercises exactly what a multi-site deployment runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from diloco.config import RunConfig
from diloco.data.sources import entropy_floor
from diloco.security import credentials
from diloco.shardmap import SEPARATOR, join_checksums
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from islands.sim.wan import LinkSpec, WanLink

log = logging.getLogger(__name__)

# Where in its workdir a simulation's coordinator checkpoints: what `diloco-export WORKDIR/ckpt/coordinator OUT` reads
# (diloco/cli/export.py's example and docs/export-and-eval.md name it; tests/test_export.py runs them as written).
COORDINATOR_CHECKPOINT = Path("ckpt") / "coordinator"


@dataclass
class SimResult:
    report: dict
    seconds: float
    island_exit_codes: list[int]
    # Bytes each island's emulated WAN link carried (up to, down from the coordinator); empty without --wan.
    wan_bytes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # The coordinator's checkpoints (diloco-export's CHECKPOINT_URL), or "" when it did not checkpoint.
    checkpoint_url: str = ""


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def island_ranks(args: Collection[str]) -> int:
    """The ranks an `islands join` command line trains on: --replica-groups x --nproc-per-node (1 x 1 unless given)."""
    flags = {"--nproc-per-node": 1, "--replica-groups": 1}
    args = list(args)
    for k, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name in flags:
            flags[name] = int(value if value else args[k + 1])
    return flags["--nproc-per-node"] * flags["--replica-groups"]


def ephemeral_ports() -> range:
    """The ports the kernel hands out for outgoing connections and binds to port 0 (Linux's default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(avoid: Collection[int] = (), span: int = 16) -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range, with the span - 1 ports above it (an FSDP island's
    replica group g serves its metrics on port + g) clear of the ports in avoid (chosen already, not bound yet).
    Below that range: the island binds it a moment later, and a port from the range could meanwhile become the local
    end of any connection (a gRPC channel took one island's metrics port in a test run, and the island exited)."""
    low = ephemeral_ports().start
    first = max(1024, low - 12000)
    if first >= low - span:  # no room below the range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, low - span)
        if any(abs(port - other) < span for other in avoid):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range ({low}) on 127.0.0.1")


def exit_reason(log_path: Path, most: int = 3) -> str:
    """What a child process that exited said of why, from its log: its error lines (the CLI's `prog: error: ...`,
    logged ERRORs; each once, the last `most` of them: every shard of a coordinator says the same), else its last
    line."""
    lines = log_path.read_text(errors="replace").strip().splitlines() if log_path.exists() else []
    errors = list(dict.fromkeys(line.strip() for line in lines if ": error: " in line or " ERROR " in line))
    return " | ".join(errors[-most:]) if errors else (lines[-1].strip() if lines else "(no output)")


def _wait_for_port(port_file: Path, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text().strip():
            return int(port_file.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"coordinator exited with status {proc.returncode} before serving: "
                               f"{exit_reason(log_path)}; see {log_path}")
        time.sleep(0.1)
    raise TimeoutError(f"coordinator did not start within {timeout_s:.0f}s; see {log_path}")


class Simulation:
    """The processes of a one-node run: start, kill and restart them; watch the rounds."""

    def __init__(self, cfg: RunConfig, islands: int, workdir: Path, threads: int = 1, checkpoints: bool = False,
                 wan: list[LinkSpec] | None = None, tls: bool = True, island_args: dict[int, list[str]] | None = None,
                 coordinator_shards: int = 1, coordinator_checkpoints: bool = False):
        self.cfg, self.islands, self.workdir, self.threads = cfg, islands, workdir, threads
        self.coordinator_shards = coordinator_shards  # K > 1: `serve --shards K`, K processes (docs/sharding.md)
        self.island_args = island_args or {}  # extra `islands join` flags per island (e.g. --throttle, --steps-per-round)
        # One emulated link per island (its own proxy port); the coordinator keeps its port across restarts.
        self.wan = wan
        self.links: dict[int, WanLink] = {}
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / "run.toml"
        self.config_path.write_text(cfg.to_toml())
        self.report_path = workdir / "report.json"
        self.checkpoints = checkpoints  # the coordinator's and every island's (islands every round): to resume any
        # Only the coordinator's, every checkpoint.every_rounds rounds and the last: the model, for diloco-export.
        self.coordinator_checkpoints = coordinator_checkpoints or checkpoints
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.coordinator: subprocess.Popen | None = None
        self.island_procs: dict[int, subprocess.Popen] = {}
        self.killed: set[int] = set()  # islands this simulation SIGKILLed (chaos): their exit is not a failure
        self.port = 0
        self.http_port = 0  # the coordinator's dashboard and metrics: any free port, then kept across restarts
        self.metrics_ports: dict[int, int] = {}  # each island's /metrics
        self.starts = 0
        # Mutual TLS as across data centres: a run CA, the coordinator's certificate, one per island
        # (island-i: the name it is known by in the run, as its log and checkpoint are) and one for watching the
        # rounds from here.
        self.tls_dir = workdir / "tls" if tls else None
        if self.tls_dir is not None and not (self.tls_dir / "ca.pem").exists():
            credentials.create_ca(self.tls_dir, run_name=cfg.name)
            credentials.issue_coordinator(self.tls_dir, ["127.0.0.1", "localhost"])
            for i in range(islands):  # each for the ranks its `islands join` flags give it, as an operator would
                credentials.issue_island(self.tls_dir, f"island-{i}", ranks=island_ranks(self.island_args.get(i, ())))
            credentials.issue_island(self.tls_dir, "sim-watch")

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        with open(self.workdir / log_name, "a") as log_file:
            return subprocess.Popen([sys.executable, "-m"] + args, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)

    def start_coordinator(self, resume: bool = False) -> None:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        http_port_file = self.workdir / "http-port"
        args = ["coordinator", "serve", "--config", str(self.config_path), "--host", "127.0.0.1",
                "--port", str(self.port), "--port-file", str(port_file), "--report", str(self.report_path),
                "--linger", "20", "--threads", str(self.threads), "--log-level", "info",
                "--http-port", str(self.http_port), "--http-port-file", str(http_port_file),
                "--log-url", str(self.workdir / "logs")]
        if self.coordinator_checkpoints:
            args += ["--checkpoint", self.checkpoint_url]
        if self.tls_dir is not None:
            args += ["--tls", str(self.tls_dir)]
        if self.coordinator_shards > 1:
            args += ["--shards", str(self.coordinator_shards)]
        if resume:
            args.append("--resume")
        self.coordinator = self._spawn(args, "coordinator.log")
        self.port = _wait_for_port(port_file, self.coordinator, 120, self.workdir / "coordinator.log")
        if http_port_file.exists():  # written before the gRPC port: the same port again after a restart
            self.http_port = int(http_port_file.read_text())

    @property
    def checkpoint_url(self) -> str:
        """The coordinator's checkpoints, or "" without them."""
        return str(self.workdir / COORDINATOR_CHECKPOINT) if self.coordinator_checkpoints else ""

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/"

    def island_address(self, i: int) -> str:
        """Where island i connects: the coordinator, or its own WAN link in front of it."""
        if not self.wan:
            return f"127.0.0.1:{self.port}"
        if i not in self.links:
            self.links[i] = WanLink(("127.0.0.1", self.port), self.wan[i % len(self.wan)]).start()
        return self.links[i].address

    def wan_bytes(self) -> list[tuple[int, int]]:
        return [(self.links[i].bytes_up, self.links[i].bytes_down) for i in sorted(self.links)]

    def start_island(self, i: int, resume: bool = False) -> None:
        args = ["islands", "join", "--coordinator", self.island_address(i), "--config", str(self.config_path),
                "--threads", str(self.threads), "--device", "cpu", "--log-level", "info"]
        if self.checkpoints:
            args += ["--checkpoint", str(self.workdir / "ckpt" / f"island-{i}"), "--checkpoint-every", "1"]
        if self.tls_dir is not None:
            args += ["--tls", str(self.tls_dir), "--tls-name", f"island-{i}"]
        if i not in self.metrics_ports:  # chosen once: a restarted island serves where it did
            self.metrics_ports[i] = free_port(self.metrics_ports.values())
        args += ["--log-url", str(self.workdir / "logs"), "--metrics-port", str(self.metrics_ports[i])]
        if resume:
            args.append("--resume")
        self.island_procs[i] = self._spawn(args + list(self.island_args.get(i, ())), f"island-{i}.log")
        self.killed.discard(i)

    def start(self) -> None:
        self.started = time.monotonic()
        if self.coordinator_checkpoints:  # a fresh run: an earlier one's newer steps here would be what diloco-export takes
            shutil.rmtree(self.checkpoint_url, ignore_errors=True)
        self.start_coordinator()
        for i in range(self.islands):
            self.start_island(i)

    def kill_island(self, i: int) -> None:
        self.killed.add(i)
        self.island_procs[i].send_signal(signal.SIGKILL)
        self.island_procs[i].wait()

    def failed_island(self) -> str | None:
        """Why the run cannot finish, if an island exited with an error of its own (not killed by us): the rounds
        would wait for it until the timeout. Its log's last line says why."""
        for i, proc in sorted(self.island_procs.items()):
            if proc.poll() not in (None, 0) and i not in self.killed:
                log = self.workdir / f"island-{i}.log"
                return f"island {i} exited with status {proc.returncode}: {exit_reason(log)}; see {log}"
        return None

    def kill_coordinator(self) -> None:
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def kill_coordinator_shard(self, shard: int, after_step: int, timeout_s: float = 120) -> None:
        """SIGKILLs shard `shard` of the `serve --shards K` coordinator once it committed checkpoint after_step or a
        later one (so it resumes at the round the others are in); its launcher starts it again with --resume
        (coordinator/launch.py)."""
        steps = Path(self.checkpoint_url) / f"shard-{shard}-of-{self.coordinator_shards}"

        def newest() -> int:
            return max((int(d.name[5:]) for d in steps.glob("step-*") if (d / "COMMITTED").exists()), default=-1)

        deadline = time.monotonic() + timeout_s
        while newest() < after_step:
            if time.monotonic() > deadline:
                raise TimeoutError(f"coordinator shard {shard} did not commit step {after_step} within {timeout_s:.0f}s")
            time.sleep(0.01)
        (pid,) = [p for p in children_of(self.coordinator.pid) if shard_index(p) == shard]
        os.kill(pid, signal.SIGKILL)

    def watch(self, timeout_s: float) -> Iterator[pb.RoundSummary]:
        """Round summaries until the run finishes, across coordinator restarts. Raises RuntimeError as soon as an
        island exits with an error of its own (failed_island), rather than waiting out the timeout for it."""
        deadline = self.started + timeout_s
        next_round: dict[int, int] = {}  # per fragment
        current: list[grpc.Future] = []  # the stream being read, for the monitor to cancel
        done = threading.Event()

        def monitor() -> None:
            while not done.wait(0.5):
                if self.failed_island() is not None:
                    for stream in current:
                        stream.cancel()
                    return

        threading.Thread(target=monitor, name="sim-island-monitor", daemon=True).start()
        try:
            finished = yield from self._summaries(deadline, next_round, current)
        finally:
            done.set()
        if finished:
            return
        if (why := self.failed_island()) is not None:
            raise RuntimeError(why)
        raise TimeoutError(f"the run did not finish within {timeout_s:.0f}s; see {self.workdir}")

    def _summaries(self, deadline: float, next_round: dict[int, int], current: list) -> Generator[pb.RoundSummary, None, bool]:
        """The round summaries of watch(); returns True once the run finished, False when the deadline passed or an
        island failed. A sharded coordinator's leader sends the run's: every shard's part of each round in it."""
        while time.monotonic() < deadline and self.failed_island() is None:
            try:
                with self._channel(f"127.0.0.1:{self.port}") as channel:
                    stub = pb_grpc.CoordinatorStub(channel)
                    stream = stub.WatchRounds(pb.WatchRequest(from_round=0), timeout=deadline - time.monotonic(),
                                              wait_for_ready=True)
                    current[:] = [stream]
                    for summary in stream:
                        if summary.round < next_round.get(summary.fragment, 0):
                            continue  # already seen before a coordinator restart
                        next_round[summary.fragment] = summary.round + 1
                        yield summary
                        if summary.run_finished:
                            return True
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    return False
                time.sleep(0.5)  # the coordinator is down or restarting
        return False

    def _channel(self, address: str) -> grpc.Channel:
        if self.tls_dir is None:
            return grpc.insecure_channel(address)
        ca, cert, key = credentials.island_files(self.tls_dir, "sim-watch").read()
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert))

    def finish(self, timeout_s: float) -> SimResult:
        remaining = max(1.0, timeout_s - (time.monotonic() - self.started))
        codes = [self.island_procs[i].wait(remaining) for i in sorted(self.island_procs)]
        self.coordinator.wait(60)
        if self.coordinator.returncode != 0:
            log_path = self.workdir / "coordinator.log"
            raise RuntimeError(f"coordinator exited with status {self.coordinator.returncode}: {exit_reason(log_path)}; see {log_path}")
        bad = [i for i, c in enumerate(codes) if c != 0]
        if bad:
            raise RuntimeError(f"islands {bad} failed; see {self.workdir}/island-N.log")
        # A sharded coordinator's launcher writes the run's report from its shards' (coordinator/launch.py).
        report = json.loads(self.report_path.read_text())
        return SimResult(report, time.monotonic() - self.started, codes, self.wan_bytes(), self.checkpoint_url)

    def close(self) -> None:
        for p in list(self.island_procs.values()) + [self.coordinator]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for link in self.links.values():
            link.stop()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is pid (Linux /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile
    return found


def shard_index(pid: int) -> int | None:
    """The --shard I a coordinator shard process was started with (its last one: argparse takes the last)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().decode().split("\0")
    except OSError:
        return None
    at = [k for k, a in enumerate(args) if a == "--shard"]
    return int(args[at[-1] + 1]) if at else None


def run_sim(
    cfg: RunConfig,
    islands: int,
    workdir: Path,
    timeout_s: float = 1800.0,
    threads: int = 1,
    echo=print,
    per_island: bool = False,
    wan: list[LinkSpec] | None = None,
    coordinator_shards: int = 1,
    checkpoint: bool = False,
) -> SimResult:
    """Runs the simulation to the end; raises if it fails or outlives timeout_s.

    wan: one emulated link per island (see islands.sim.wan), or None for plain loopback; coordinator_shards: the
    coordinator's shard processes (docs/sharding.md); checkpoint: the coordinator checkpoints under
    workdir/ckpt/coordinator (COORDINATOR_CHECKPOINT), for diloco-export.
    """
    sim = Simulation(cfg, islands, workdir, threads, wan=wan, coordinator_shards=coordinator_shards,
                     coordinator_checkpoints=checkpoint)
    try:
        sim.start()
        echo(f"dashboard: {sim.dashboard_url}   metrics: {sim.dashboard_url}metrics")
        echo("island metrics: " + "  ".join(f"http://127.0.0.1:{p}/metrics" for _, p in sorted(sim.metrics_ports.items())))
        printer = RoundPrinter(echo, per_island, cfg.streaming.fragments)
        for summary in sim.watch(timeout_s):
            printer.print(summary)
        return sim.finish(timeout_s)
    finally:
        sim.close()


EVENT_LABELS = {
    "leases_expired": "leases expired", "dropped_nonfinite": "non-finite contributions dropped",
    "checksum_resyncs": "checksum resyncs", "late_pushes": "late pushes refused", "late_folded": "late pushes folded",
    "restarts": "coordinator restarts", "rounds_lost": "rounds lost", "recovery_s": "coordinator recovery",
    "island_restarts": "island restarts", "island_silent_s": "restarted islands silent for",
}


class RoundPrinter:
    """One line per closed round: islands, losses, bytes, and the running factor against data-parallel.

    With Streaming DiLoCo, one line per fragment-round, the fragment in its own column.
    """

    def __init__(self, echo, per_island: bool = False, fragments: int = 1):
        self.echo, self.per_island = echo, per_island
        self.fragments = fragments
        self.sent = self.ddp = 0.0
        # Per island: its bytes against one data-parallel rank's share, 2(n-1)/n x 4 bytes x params per step.
        self.island_sent: dict[str, float] = {}
        self.island_ddp: dict[str, float] = {}
        frag = f"{'frag':>4} " if fragments > 1 else ""
        echo(f"{'round':>5} {frag}{'islands':>7} {'train':>7} {'eval':>7} {'up':>10} {'down':>10} {'vs DDP':>8} {'secs':>6}")

    def print(self, s: pb.RoundSummary, note: str = "") -> None:
        self.sent += s.bytes_up + s.bytes_down
        self.ddp += s.ddp_bytes
        eval_text = "-" if math.isnan(s.eval_loss) else f"{s.eval_loss:.4f}"
        factor = f"{self.ddp / self.sent:.1f}x" if self.sent and self.ddp else "-"
        extra = (f"  dropped: {', '.join(s.dropped)}" if s.dropped else "") + (f"  {note}" if note else "")
        frag = f"{s.fragment:>4} " if self.fragments > 1 else ""
        self.echo(
            f"{s.round:>5} {frag}{len(s.islands):>7} {s.train_loss:>7.4f} {eval_text:>7} "
            f"{_fmt_bytes(s.bytes_up):>10} {_fmt_bytes(s.bytes_down):>10} {factor:>8} {s.seconds:>6.1f}{extra}"
        )
        if self.per_island:
            for t in s.traffic:
                sent = self.island_sent[t.island_id] = self.island_sent.get(t.island_id, 0.0) + t.bytes_up + t.bytes_down
                ddp = self.island_ddp[t.island_id] = self.island_ddp.get(t.island_id, 0.0) + s.ddp_bytes / max(1, len(s.islands))
                island_factor = f"{ddp / sent:.1f}x" if sent and ddp else "-"
                self.echo(f"{'':>5} {t.island_id:>15} {'':>7} {_fmt_bytes(t.bytes_up):>10} {_fmt_bytes(t.bytes_down):>10} {island_factor:>8}")


def summarize(result: SimResult, cfg: RunConfig, echo=print) -> None:
    rep = result.report
    rounds = rep["rounds"]
    evals = [r["eval_loss"] for r in rounds if r["eval_loss"] is not None]
    up = sum(r["bytes_up"] for r in rounds)
    down = sum(r["bytes_down"] for r in rounds)
    ddp = sum(r["ddp_bytes"] for r in rounds)
    echo("")
    what = f"{len(rounds)} rounds" if rep.get("fragments", 1) == 1 else f"{len(rounds)} fragment-rounds ({rep['fragments']} fragments)"
    echo(f"finished {what} in {result.seconds:.1f}s (codec up {rep['codec']}, down {rep['downlink_codec']})")
    if evals and rep["initial_eval_loss"] is not None:
        echo(f"eval loss of the global parameters: {rep['initial_eval_loss']:.4f} -> {evals[-1]:.4f}")
    floor = entropy_floor(cfg.data)
    if floor is not None and evals:
        echo(f"entropy floor of the synthetic language: {floor:.4f} nats/token (gap {evals[-1] - floor:.4f})")
    echo(f"bytes up {_fmt_bytes(up)}, down {_fmt_bytes(down)}"
         + (f"; data-parallel would have sent {_fmt_bytes(ddp)} ({ddp / (up + down):.1f}x more)" if ddp and up + down else ""))
    clipped = sum(len(r.get("clipped", [])) for r in rounds)
    if clipped:
        echo(f"norm guard: {clipped} pseudo-gradient(s) clipped to the reference norm (robust.norm_factor)")
    data = rep.get("data")
    if data:
        echo(f"token corpus: {data['tokens_trained']:,} tokens trained, {data['tokens_lost']:,} lost with discarded rounds, "
             f"{data['tokens_returned']:,} leased and handed back untrained, {data['tokens_repeated']:,} trained twice")
    ev = rep.get("events", {})
    failures = {k: v for k, v in ev.items() if v}
    if failures:
        echo("failures and recovery: " + ", ".join(
            f"{EVENT_LABELS.get(k, k)} {v:.1f}s" if isinstance(v, float) else f"{EVENT_LABELS.get(k, k)} {v}"
            for k, v in failures.items()))
    if result.wan_bytes:
        echo(f"emulated WAN links carried up {_fmt_bytes(sum(u for u, _ in result.wan_bytes))}, "
             f"down {_fmt_bytes(sum(d for _, d in result.wan_bytes))} (gRPC framing included)")
    stats = [s for s in rep.get("island_stats", {}).values() if s.get("wall_s")]
    if stats:
        util = [s["compute_s"] / s["wall_s"] for s in stats]
        waits = ", ".join(f"{s['wait_s']:.1f}s" for s in stats)
        others = ", ".join(f"{s.get('straggler_s', 0.0):.1f}s" for s in stats)
        echo(f"compute utilization (inner steps / island wall time): mean {sum(util) / len(util):.1%}, "
             f"per island {', '.join(f'{u:.1%}' for u in util)}; waiting for results {waits} (for other islands {others})")
    matches = sum(1 for c in rep["islands"].values() if c == rep["checksum"])
    short = join_checksums([part[:12] for part in rep["checksum"].split(SEPARATOR)])  # a sharded coordinator's: every shard's
    echo(f"islands holding the coordinator's global parameters: {matches}/{len(rep['islands'])} (checksum {short})")
    if result.checkpoint_url:
        echo(f"the model, as a Hugging Face folder: diloco-export {result.checkpoint_url} OUT_DIR (docs/export-and-eval.md)")
