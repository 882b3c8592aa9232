"""Multi-process runs of sharded islands, for tests/test_fsdp_islands.py.

    python tests/fsdp_scenarios.py SCENARIO WORKDIR

runs a coordinator in this process and islands as `python -m islands join`
processes (torchrun underneath), waits for the run to end, and leaves under
WORKDIR: result.json (the coordinator's report plus what the scenario did),
coordinator.pt (the final global parameters) and each island's --report-dir.
torchft's managers and checkpoint servers bind every interface, so the tests
start this inside a network namespace that has only loopback (unshare -rn).
Every wait is bounded; every process started here is killed on the way out.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from conftest import claim, one_island_config, tiny_config  # noqa: E402
from coordinator.launch import merged_report, shard_ports  # noqa: E402
from coordinator.server import start_coordinator  # noqa: E402
from coordinator.sharding import ShardRole  # noqa: E402
from diloco.wire.codec import Fp32Codec  # noqa: E402
from diloco.v1 import diloco_pb2 as pb  # noqa: E402
from diloco.wire.messages import Manifest, tensor_chunks  # noqa: E402
from islands.client import CoordinatorClient, ReplayableChunks  # noqa: E402

log = logging.getLogger("scenario")

SHARDED_FLAGS = [
    "--device", "cpu", "--threads", "1", "--ft-host", "127.0.0.1", "--ft-timeout", "15",
    "--ft-heartbeat-timeout", "2", "--ft-startup-wait", "60", "--connect-timeout", "30",
]


class Run:
    """A coordinator here, islands as process groups; everything stops in close()."""

    def __init__(self, workdir: Path, cfg, deadline_s: float, coordinator_shards: int = 0):
        """coordinator_shards K > 0: the coordinator as K shards here (docs/sharding.md), islands told of them by the
        leader (self.coordinator; self.shards holds them all)."""
        self.workdir, self.cfg = workdir, cfg
        self.deadline = time.monotonic() + deadline_s
        self.config_path = workdir / "run.toml"
        self.config_path.write_text(cfg.to_toml())
        self.followers = []  # a sharded coordinator's other shards; self.coordinator is the leader (scenarios may replace it)
        if coordinator_shards:
            ports = shard_ports("127.0.0.1", 0, coordinator_shards)
            addresses, secret = tuple(f"127.0.0.1:{p}" for p in ports), os.urandom(32)
            shards = [start_coordinator(cfg, "127.0.0.1", port, spool_dir=str(workdir / f"spool-{i}"),
                                        shard=ShardRole(i, addresses, secret)) for i, port in enumerate(ports)]
            self.coordinator, self.followers = shards[0], shards[1:]
        else:
            self.coordinator = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(workdir / "spool"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = dict(
            os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
            # Buffers above 64 KiB become their own mappings, so the peak RSS shows every one of them.
            MALLOC_MMAP_THRESHOLD_="65536",
        )
        self.notes: dict = {}

    @property
    def shards(self) -> list:
        return [self.coordinator, *self.followers]

    def island(self, name: str, *flags: str, env: dict | None = None, module: list[str] | None = None) -> None:
        argv = [sys.executable, "-m", *(module or ["islands"]), "join", "--coordinator", f"127.0.0.1:{self.coordinator.port}",
                "--config", str(self.config_path), *flags]
        with open(self.workdir / f"{name}.log", "w") as out:
            self.procs[name] = subprocess.Popen(argv, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True, cwd=ROOT)

    def left(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"scenario ran past its deadline; logs in {self.workdir}")
        return remaining

    def finish(self) -> None:
        if not all(shard.wait(self.left()) for shard in self.shards):
            raise TimeoutError("the run did not finish")
        codes = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(self.left())
            except subprocess.TimeoutExpired:
                codes[name] = None
        self.notes["exit_codes"] = codes
        report = merged_report([shard.report() for shard in self.shards])  # the run's, as `serve --shards K` writes it
        report["notes"] = self.notes
        (self.workdir / "result.json").write_text(json.dumps(report, indent=1))
        torch.save({n: t.clone() for shard in self.shards for n, t in shard.state.params.items()}, self.workdir / "coordinator.pt")
        momentum = {n: f.outer.optimizer.state[p]["momentum_buffer"].clone()
                    for shard in self.shards for f in shard.state.fragments for n, p in f.outer.params.items()}
        torch.save(momentum, self.workdir / "momentum.pt")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        for shard in self.shards:
            shard.stop(0.5)


class Puppet:
    """A second island driven from here over the protocol: it pushes a zero pseudo-gradient when told,
    so the scenario decides when each round may close."""

    def __init__(self, port: int, cfg):
        self.client = CoordinatorClient(f"127.0.0.1:{port}", connect_timeout_s=10)
        # One inner step of one rank (PER_STEP = 128 tokens in tiny_config) a round: the least a push can claim honestly
        # (robust.check_claims) with weight, so that a round of the puppet alone still folds and steps.
        self.claim = claim(cfg)
        joined = self.client.join(cfg.digest(), "fp32")
        self.island_id, self.chunk_bytes = joined.island_id, joined.max_chunk_bytes
        self.manifest = Manifest.from_proto(joined.parameters)
        self.zeros = {n: torch.zeros(s) for n, s in self.manifest.shapes.items()}
        self.fragments = [list(f.names) for f in joined.fragments]
        self.client.start_heartbeat(lambda: self.island_id, joined.heartbeat_interval_s, lambda: 0)

    def push(self, round_: int, fragment: int = 0) -> None:
        """A zero push for round_ (the fragment's current round), naming the parameters it was trained from."""
        header = pb.PushHeader(island_id=self.island_id, round=round_, train_loss=0.0, codec="fp32", fragment=fragment,
                               global_checksum=self.checksum(fragment), **self.claim)
        zeros = {n: self.zeros[n] for n in self.fragments[fragment]} if self.fragments else self.zeros
        self.client.push(header, ReplayableChunks(tensor_chunks(zeros, Fp32Codec(), self.chunk_bytes)))

    def checksum(self, fragment: int = 0) -> str:
        """The checksum of the fragment's current global parameters, fetched as an island fetches them."""
        header = self.client.fetch(self.island_id, {n: torch.zeros_like(t) for n, t in self.zeros.items()}, self.manifest)
        return header.fragments[fragment].checksum if header.fragments else header.checksum

    def close(self) -> None:
        self.client.leave(self.island_id, "", 0)
        self.client.close()


def events(report_dir: Path, tag: str) -> list[dict]:
    path = report_dir / f"{tag}.events"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def wait_until(run: Run, what: str, condition, poll_s: float = 0.1, timeout_s: float = 90.0):
    give_up = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if run.left() < 1 or time.monotonic() > give_up:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(poll_s)


def two_islands(workdir: Path) -> None:
    """A 2 replica groups x 2 FSDP ranks island and a 1-rank island in one run; memory measured."""
    cfg = tiny_config(
        "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.d_ff=1024", "inner.steps_per_round=3",
        "rounds.rounds=4", "rounds.min_islands=2", "data.shards=2", "wire.chunk_bytes=65536", "rounds.deadline_s=120",
        "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
    )
    run = Run(workdir, cfg, deadline_s=200)
    try:
        run.island("sharded", "--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "0",
                   "--report-dir", str(workdir / "sharded"), "--measure-memory", "--receive-window", "262144", *SHARDED_FLAGS)
        run.island("single", "--device", "cpu", "--threads", "1")
        run.finish()
    finally:
        run.close()


def faults(workdir: Path, corpus: str = "") -> None:
    """SIGKILL replica group 1 while round 1 is open; in round 3 the pushing group 0 dies mid-push
    (one rank delivered its shard, the other died before pushing). A puppet island holds rounds 2
    and 4 open until the killed group is back, so that it rejoins while the run still has rounds.
    With a corpus URL the island reads that token corpus through leases."""
    tokens = ["data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0", f"data.cache_dir={str(workdir / 'cache')!r}",
              "data.shuffle_block=8"] if corpus else []
    cfg = tiny_config(
        "model.n_layers=2", "inner.steps_per_round=3", "rounds.rounds=7", "rounds.min_islands=2", "data.shards=2",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30", *tokens,
    )
    run = Run(workdir, cfg, deadline_s=230)
    reports = workdir / "sharded"
    puppet = None
    try:
        run.island("sharded", "--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "2",
                   "--report-dir", str(reports), *SHARDED_FLAGS,
                   env={"DILOCO_FAULT": "die-before-push:group=0,rank=1,round=3,delay=1"})
        puppet = Puppet(run.coordinator.port, cfg)
        state = run.coordinator.state
        sharded_id = wait_until(run, "the sharded island to join", lambda: next((i for i in state.islands if i != puppet.island_id), None))
        run.notes["sharded_island"], run.notes["puppet"] = sharded_id, puppet.island_id
        for round_ in range(cfg.rounds.rounds):
            def contributed():
                with state.cond:
                    c = state.fragments[0].contributions.get(sharded_id)
                    return state.round == round_ and c is not None and c.state == "complete"

            wait_until(run, f"the sharded island's contribution to round {round_}", contributed)
            if round_ == 1:
                pids = [e["pid"] for r in (0, 1) for e in events(reports, f"g1-r{r}-a0") if e["event"] == "up"]
                # Group 1's torchrun agent is held (SIGSTOP) until group 0 has pushed round 2 alone: without
                # that, how much of round 2 group 0 trains alone depends on how fast torchrun restarts group 1.
                agents = sorted({parent_pid(pid) for pid in pids})
                for pid in agents:
                    os.kill(pid, signal.SIGSTOP)
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                run.notes["killed"] = {"round": 1, "group": 1, "pids": pids, "t": time.time()}
            if round_ == 2:
                for pid in agents:
                    os.kill(pid, signal.SIGCONT)
            if round_ in (2, 4):
                group = 1 if round_ == 2 else 0
                wait_until(run, f"group {group} to come back", lambda: all(
                    any(e["event"] == "up" for a in (1, 2) for e in events(reports, f"g{group}-r{r}-a{a}")) for r in (0, 1)))
            puppet.push(round_)
        run.finish()
    finally:
        if puppet is not None:
            puppet.close()
        run.close()


def torchrun(workdir: Path) -> None:
    """An island started by a plain torchrun (no launcher): 1 replica group x 2 FSDP ranks, pushing
    top-k with its residual kept in the local shards (wire.feedback_in_model)."""
    cfg = one_island_config("model.n_layers=2", "rounds.rounds=3", "rounds.heartbeat_s=0.5", "wire.codec='topk'",
                            "wire.topk_density=0.1", "wire.feedback_in_model=true", "wire.downlink_codec='int8'")
    run = Run(workdir, cfg, deadline_s=150)
    try:
        run.island("torchrun", "--device", "cpu", "--threads", "1", "--report-dir", str(workdir / "torchrun"),
                   module=["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "islands"])
        run.finish()
    finally:
        run.close()


def cuda(workdir: Path, nproc: str = "0", groups: str = "1") -> None:
    """The GPU paths: a one-rank island under bf16 autocast and, when nproc > 0, a sharded island of
    groups x nproc ranks (FSDP2 over NCCL with bf16 compute; torchft over NCCL when groups > 1)."""
    sharded = int(nproc) > 0
    cfg = tiny_config(
        "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.d_ff=1024", "inner.steps_per_round=3",
        # Without the sharded island the single one runs alone: its first outer step needs no second.
        "rounds.rounds=3", f"rounds.min_islands={2 if sharded else 1}", f"robust.first_quorum={2 if sharded else 1}",
        "data.shards=2", "wire.chunk_bytes=65536",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
    )
    run = Run(workdir, cfg, deadline_s=200)
    try:
        if sharded:
            flags = ["cuda" if f == "cpu" else f for f in SHARDED_FLAGS]
            run.island("sharded", "--nproc-per-node", nproc, "--replica-groups", groups, "--max-restarts", "0",
                       "--report-dir", str(workdir / "sharded"), *flags)
        run.island("single", "--device", "cuda")
        run.finish()
    finally:
        run.close()


def time_boxed(workdir: Path) -> None:
    """Time-boxed rounds with P = 2 fragments and tau = 1 on a 2 replica groups x 2 FSDP ranks island, beside a
    one-rank island throttled to 0.4 s a step: every rank of every group must end each round at the same step."""
    cfg = tiny_config(
        "model.n_layers=2", "streaming.fragments=2", "streaming.tau=1", "inner.steps_per_round=4", "inner.max_steps=16",
        "rounds.rounds=4", "rounds.mode='time'", "rounds.round_s=1.5", "rounds.min_islands=2", "data.shards=2",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
    )
    run = Run(workdir, cfg, deadline_s=200)
    try:
        run.island("sharded", "--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "0",
                   "--report-dir", str(workdir / "sharded"), *SHARDED_FLAGS)
        run.island("single", "--device", "cpu", "--threads", "1", "--throttle", "0.4")
        run.finish()
    finally:
        run.close()


def _proc_state(pid: int) -> str:
    """The process's state letter from /proc (Z: dead, not yet reaped), or "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _exit_of(pid: int) -> str:
    """How a dead process ended, read from its zombie (orphans come to this process, PID 1 of the namespace,
    which reaps them here), or "" if it was reaped by someone else."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = int(f.read().rsplit(")", 1)[1].split()[49])  # exit_code (proc(5) field 52)
    except (OSError, IndexError, ValueError):
        code = None
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    if code is None:
        return ""
    return f"signal {code & 0x7f}" if code & 0x7f else f"exit {code >> 8}"


def launcher_killed(workdir: Path) -> None:
    """A 1 x 2 island started by `islands join --nproc-per-node 2 --checkpoint DIR`, held at its round-0 push
    (so its ranks stay up, idle). Once both ranks are up: a second copy with the same --checkpoint (a
    --resume) is started and must exit by itself, refused; then the launcher is SIGKILLed and every pid of
    the island (torchrun, both ranks) is watched until it is gone or dead. This process is PID 1 of the
    scenario's PID namespace, so the orphans come to it: it reaps them and records how they died."""
    cfg = tiny_config("model.n_layers=2", "rounds.rounds=3", "rounds.heartbeat_s=0.5", "rounds.lease_s=60",
                      "rounds.deadline_s=600")
    run = Run(workdir, cfg, deadline_s=200)
    reports, ckpt = workdir / "island", workdir / "ckpt"
    flags = ["--nproc-per-node", "2", "--max-restarts", "0", "--checkpoint", str(ckpt), "--checkpoint-every", "100",
             *SHARDED_FLAGS]
    notes = run.notes
    try:
        run.island("first", *flags, "--report-dir", str(reports), env={"DILOCO_FAULT": "hold-before-push:round=0,delay=600"})
        launcher = run.procs["first"]
        def up() -> list[int] | None:
            pids = [e["pid"] for r in (0, 1) for e in events(reports, f"g0-r{r}-a0") if e["event"] == "up"]
            return pids if len(pids) == 2 else None

        ranks = wait_until(run, "both ranks up", up, timeout_s=150)
        torchruns = sorted({parent_pid(pid) for pid in ranks})
        notes.update(launcher=launcher.pid, ranks=ranks, torchruns=torchruns,
                     torchrun_parents=[parent_pid(pid) for pid in torchruns], joined=len(run.coordinator.state.islands))

        # A second copy of the island beside the first: refused at its start, whatever it was asked to do.
        run.island("second", *flags, "--resume")
        try:
            code = run.procs["second"].wait(min(120.0, run.left()))
        except subprocess.TimeoutExpired:
            code = None
        notes["second"] = {"code": code, "log": (workdir / "second.log").read_text(),
                           "joined_after": len(run.coordinator.state.islands),
                           "first_alive": launcher.poll() is None and all(_proc_state(p) not in ("", "Z") for p in ranks)}

        # SIGKILL the launcher: torchrun and both ranks must go with it.
        watched = [*torchruns, *ranks]
        killed_at = time.monotonic()
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(30)
        gone: dict[int, float] = {}
        how: dict[int, str] = {}
        give_up = killed_at + 60
        while len(gone) < len(watched) and time.monotonic() < give_up:
            for pid in watched:
                if pid in gone:
                    continue
                if _proc_state(pid) in ("", "Z", "X"):
                    gone[pid] = time.monotonic() - killed_at
                    how[pid] = _exit_of(pid)
            time.sleep(0.005)
        notes["gone_s"] = {str(pid): round(t, 4) for pid, t in gone.items()}
        notes["how"] = {str(pid): h for pid, h in how.items()}
        notes["remaining"] = {str(pid): _proc_state(pid) for pid in watched if pid not in gone}

        # The launcher's lock went with it: the next copy (the --resume one would start now) gets it.
        import fcntl

        with open(ckpt / "island.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                notes["lock_free_after"] = True
            except OSError:
                notes["lock_free_after"] = False
    finally:
        run.close()
        (workdir / "result.json").write_text(json.dumps({"notes": notes}, indent=1))


def sharded_coordinator(workdir: Path, shards: str) -> None:
    """A 1 x 2 FSDP island and a 1-rank island against a coordinator of `shards` shards (0: one process), 4-bit
    pushes: the FSDP ranks' ranges cut the parameters at other places than the shards do."""
    cfg = tiny_config(
        "model.d_model=64", "model.n_layers=2", "model.d_ff=128", "inner.steps_per_round=3", "rounds.rounds=3",
        "rounds.min_islands=2", "data.shards=2", "wire.codec='e3m0'", "rounds.heartbeat_s=0.5", "rounds.deadline_s=120",
    )
    run = Run(workdir, cfg, deadline_s=200, coordinator_shards=int(shards))
    try:
        run.island("sharded", "--nproc-per-node", "2", "--max-restarts", "0", "--report-dir", str(workdir / "sharded"),
                   *SHARDED_FLAGS)
        run.island("single", "--device", "cpu", "--threads", "1")
        run.finish()
    finally:
        run.close()


def refused_at_join(workdir: Path) -> None:
    """A 1 x 2 island whose config is not the run's, with torchrun's default restarts: refused at join, it must end
    at once in one line, as a one-rank island does, not be restarted and end in a traceback."""
    cfg = tiny_config("model.n_layers=2", "rounds.rounds=3", "rounds.heartbeat_s=0.5")
    run = Run(workdir, cfg, deadline_s=200)
    other = workdir / "other.toml"
    other.write_text(tiny_config("model.n_layers=2", "rounds.rounds=3", "rounds.heartbeat_s=0.5", "inner.lr=1e-2").to_toml())
    try:
        started = time.monotonic()
        run.island("refused", "--nproc-per-node", "2", "--config", str(other), *SHARDED_FLAGS)
        code = run.procs["refused"].wait(run.left())
        run.notes.update(code=code, seconds=time.monotonic() - started, log=(workdir / "refused.log").read_text(),
                         joined=len(run.coordinator.state.islands))
    finally:
        run.close()
        (workdir / "result.json").write_text(json.dumps({"notes": run.notes}, indent=1))


SCENARIOS = {"refused_at_join": refused_at_join, "two_islands": two_islands, "faults": faults, "torchrun": torchrun, "cuda": cuda, "time_boxed": time_boxed,
             "launcher_killed": launcher_killed, "sharded_coordinator": sharded_coordinator}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [scenario] %(levelname)s %(name)s: %(message)s")
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
