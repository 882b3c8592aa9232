"""Stopped-and-resumed runs of a sharded island, for tests/test_shard_checkpoint.py.

    python tests/shard_resume_scenarios.py SCENARIO WORKDIR [local|s3]

The coordinator and the island are processes here (`python -m coordinator
serve`, `python -m islands join --nproc-per-node 2 ...`), so both can be
SIGKILLed: the island's whole process tree (launcher, torchrun agent, ranks:
each in its own session). With s3, moto's S3 server runs in this process
(it keeps buckets in its memory) and the children get its address through
AWS_ENDPOINT_URL. Started by the test inside `unshare -rn` (loopback only).
Every wait is bounded; every process started here is killed on the way out.
Leaves WORKDIR/result.json.
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

from conftest import one_island_config  # noqa: E402
from diloco.checkpoint import CheckpointStore  # noqa: E402

log = logging.getLogger("scenario")

ISLAND_FLAGS = [
    "--device", "cpu", "--threads", "1", "--ft-host", "127.0.0.1", "--ft-timeout", "30",
    "--ft-heartbeat-timeout", "2", "--ft-startup-wait", "60", "--connect-timeout", "60", "--max-restarts", "0",
]


def process_tree(pid: int) -> list[int]:
    """pid and its descendants, parents first (from /proc; torchrun puts each rank in its own session)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        found.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


class Run:
    def __init__(self, workdir: Path, cfg, storage: str, deadline_s: float):
        self.workdir, self.cfg = workdir, cfg
        self.deadline = time.monotonic() + deadline_s
        self.config_path = workdir / "run.toml"
        self.config_path.write_text(cfg.to_toml())
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.procs: dict[str, subprocess.Popen] = {}
        self.moto = None
        if storage == "s3":
            self.base = self._start_s3()
        else:
            self.base = str(workdir / "ckpt")
        self.port = 0

    def _start_s3(self) -> str:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        aws = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
        os.environ.update(aws)
        self.env.update(aws)
        boto3.client("s3").create_bucket(Bucket="diloco-test")
        return "s3://diloco-test"

    def left(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"scenario ran past its deadline; logs in {self.workdir}")
        return remaining

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "a") as out:
            proc = subprocess.Popen([sys.executable, "-m", *argv], env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=ROOT)
        self.procs[name] = proc
        return proc

    def coordinator(self, tag: str, checkpoint: str = "", resume: bool = False) -> None:
        port_file = self.workdir / f"port-{tag}"
        argv = ["coordinator", "serve", "--config", str(self.config_path), "--host", "127.0.0.1", "--port", "0",
                "--port-file", str(port_file), "--report", str(self.workdir / f"report-{tag}.json"), "--linger", "30",
                "--threads", "1"]
        argv += ["--checkpoint", checkpoint] if checkpoint else []
        argv += ["--resume"] if resume else []
        proc = self._spawn(f"coordinator-{tag}", argv)
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or self.left() < 1:
                raise RuntimeError(f"coordinator {tag} did not start; see {self.workdir}")
            time.sleep(0.1)
        self.port = int(port_file.read_text())

    def island(self, tag: str, *flags: str, env: dict | None = None) -> None:
        self._spawn(f"island-{tag}", ["islands", "join", "--coordinator", f"127.0.0.1:{self.port}",
                                      "--config", str(self.config_path), *ISLAND_FLAGS, *flags], env)

    def wait_until(self, what: str, condition, timeout_s: float = 120.0):
        give_up = time.monotonic() + timeout_s
        while not condition():
            for name, p in self.procs.items():
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{name} exited with status {p.returncode} while waiting for {what}; see {self.workdir}")
            if self.left() < 1 or time.monotonic() > give_up:
                raise TimeoutError(f"gave up waiting for {what}; see {self.workdir}")
            time.sleep(0.05)

    def finish(self, tag: str) -> dict:
        codes = {}
        for name, p in self.procs.items():
            if name.endswith(tag):
                try:
                    codes[name] = p.wait(self.left())
                except subprocess.TimeoutExpired:
                    codes[name] = None
        report = json.loads((self.workdir / f"report-{tag}.json").read_text())
        return {"exit_codes": codes, "checksum": report["checksum"], "final_round": report["final_round"],
                "islands": report["islands"], "restarts": report["events"]["restarts"]}

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                kill_tree(p)
        if self.moto is not None:
            self.moto.stop()


def config(streaming: bool = False, optimizer: str = "adamw"):
    """A lossy uplink with error feedback, so that the residual has to survive the restart too; with
    streaming, Streaming DiLoCo (2 fragments, tau 1, alpha 0.5, eager updates) on top; the inner
    optimizer `optimizer` (muon: its momentum buffers are checkpointed too)."""
    extra = ["inner.steps_per_round=4", "streaming.fragments=2", "streaming.tau=1", "streaming.alpha=0.5",
             "streaming.eager=true"] if streaming else ["inner.steps_per_round=3"]
    return one_island_config(
        "model.n_layers=2", "rounds.rounds=6", "rounds.min_islands=1", "data.shards=1",
        "rounds.heartbeat_s=0.5", "rounds.lease_s=60", "rounds.deadline_s=120", "checkpoint.every_rounds=2",
        "wire.codec='int8'", "wire.error_feedback=true", f"inner.optimizer={optimizer!r}", *extra,
    )


def resume(workdir: Path, storage: str = "local", groups: int = 1, nproc: int = 2, streaming: bool = False,
           optimizer: str = "adamw") -> None:
    """An uninterrupted run, then the same run stopped by SIGKILL (coordinator and island) right after
    both committed their round-2 checkpoints and restarted with --resume.

    Checkpoint steps count rounds over all fragments: round 2 is step 2 * fragments."""
    cfg = config(streaming, optimizer)
    k = 2 * cfg.streaming.fragments
    run = Run(workdir, cfg, storage, deadline_s=float(os.environ.get("SCENARIO_DEADLINE_S", "400")))
    shape = ["--nproc-per-node", str(nproc), "--replica-groups", str(groups)]
    result: dict = {"storage": storage, "base": run.base, "groups": groups, "step": k}
    try:
        # The uninterrupted run goes on alongside the stopped one (both are mostly waiting on startups).
        started = time.monotonic()
        run.coordinator("straight")
        run.island("straight", *shape)
        coord_url, island_url = f"{run.base}/coordinator", f"{run.base}/island"
        coordinator_store, island_store = CheckpointStore(coord_url), CheckpointStore(island_url)
        run.coordinator("first", coord_url)
        # The island holds its round-2 push until it is killed, so neither side gets past the round-2
        # checkpoints, however fast the island trains next to the kill.
        run.island("first", *shape, "--checkpoint", island_url, "--checkpoint-every", "2",
                   env={"DILOCO_FAULT": "hold-before-push:round=2,delay=600"})
        run.wait_until("checkpoints of round 2", lambda: k in coordinator_store.steps() and k in island_store.steps())
        kill_tree(run.procs["island-first"])
        kill_tree(run.procs["coordinator-first"])
        result["killed"] = {"coordinator_steps": coordinator_store.steps(), "island_steps": island_store.steps()}
        result["island_meta"] = island_store.load_files(k)[1]
        # A torn step (DCP files, no marker) and a damaged one (marker, a file cut short), both newer:
        # a resume must pass over them.
        fs, src = island_store.fs, f"{island_store.root}/step-{k:010d}"
        for step in (k + 2, k + 4):
            if fs.exists(f"{island_store.root}/step-{step:010d}"):  # a save the kill cut short
                fs.rm(f"{island_store.root}/step-{step:010d}", recursive=True)
            fs.copy(src, f"{island_store.root}/step-{step:010d}", recursive=True)
            fs.invalidate_cache(island_store.root)
        fs.rm(f"{island_store.root}/step-{k + 2:010d}/COMMITTED")
        with fs.open(f"{island_store.root}/step-{k + 4:010d}/__{nproc - 1}_0.distcp", "wb") as f:
            f.write(b"cut short")
        run.coordinator("resumed", coord_url, resume=True)
        run.island("resumed", *shape, "--checkpoint", island_url, "--checkpoint-every", "2", "--resume")
        result["resumed"] = run.finish("resumed")
        result["straight"] = run.finish("straight")
        result["seconds"] = time.monotonic() - started
        result["island_steps_after"] = island_store.steps()
    finally:
        run.close()
        (workdir / "result.json").write_text(json.dumps(result, indent=1, default=str))


def die_mid_save(workdir: Path, storage: str = "local") -> None:
    """2 replica groups x 2 ranks; rank 0 of the saving group 0 dies after the DCP files of round 2
    are written, before the marker. Group 1 must save round 2 again and finish the run alone (group 0
    is not restarted: the tiny run would end before a restart came back, so the launcher exits 1)."""
    run = Run(workdir, config(), storage, deadline_s=float(os.environ.get("SCENARIO_DEADLINE_S", "400")))
    result: dict = {"storage": storage, "base": run.base}
    island_url = f"{run.base}/island"
    try:
        run.coordinator("run")
        run.env["DILOCO_FAULT"] = "die-before-commit:group=0,rank=0,round=2"
        run.island("run", "--nproc-per-node", "2", "--replica-groups", "2", "--checkpoint", island_url, "--checkpoint-every", "2")
        result["run"] = run.finish("run")
        store = CheckpointStore(island_url)
        result["island_steps"] = store.steps()
        result["metas"] = {step: store.load_files(step)[1] for step in store.steps()}
    finally:
        run.close()
        (workdir / "result.json").write_text(json.dumps(result, indent=1, default=str))


SCENARIOS = {"resume": resume, "die_mid_save": die_mid_save}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [scenario] %(levelname)s %(name)s: %(message)s")
    name, workdir = sys.argv[1], Path(sys.argv[2])
    workdir.mkdir(parents=True, exist_ok=True)
    # ARGS: storage [groups [nproc [streaming [optimizer]]]]
    extra = dict(zip(("groups", "nproc", "streaming"), (int(a) for a in sys.argv[4:7])))
    extra.update({"optimizer": a for a in sys.argv[7:8]})
    SCENARIOS[name](workdir, *(sys.argv[3:4]), **{k: bool(v) if k == "streaming" else v for k, v in extra.items()})
