"""How a coordinator's shards are launched: `diloco-coordinator serve --shards K` on one machine starts the K shard
processes, which die with it (diloco/cli/lifetime.py), and waits for them; under the field's launchers a shard reads its
place and the shards' secret from its environment (launcher_index, shard_secret).

Each child is the same command with `--shard I` and the shards' addresses
appended (argparse takes an option's last value), on port P+I, with a secret the
shards share in its environment. Across machines the launcher is the field's
(torchrun, SLURM, a StatefulSet; docs/sharding.md), never this.

With --checkpoint, a shard killed by a signal (the OOM killer, a crash, an
operator's SIGKILL) is started again with --resume, at most MAX_RESTARTS times
per shard in a run, as torchrun restarts a rank: the others keep serving and it resumes at
the round they are in. So is a shard that stopped with ROLL_BACK_EXIT to resume
with the others from their common checkpoint (coordinator/rollback.py), at most
MAX_ROLL_BACKS times per shard. A shard
that exits with an error of its own stops the rest (a restart would meet the
same error), and so does the launcher's own stop.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from coordinator.rollback import ROLL_BACK_EXIT
from diloco.config import ConfigError
from diloco.cli.lifetime import child_dies_with

log = logging.getLogger(__name__)

SECRET_ENV = "DILOCO_SHARD_SECRET"  # hex; made by `serve --shards K`, handed to remote shards by their launcher
MAX_RESTARTS = 3  # restarts of each shard killed by a signal in one run
MAX_ROLL_BACKS = 3  # restarts of each shard stopped to resume with the others (a roll-back restarts every shard)

_WILDCARD = ("", "0.0.0.0", "::")


def advertised_host(host: str) -> str:
    """The host islands reach a shard bound to host at: itself, or for a wildcard this machine's name if it resolves."""
    if host not in _WILDCARD:
        return host
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"


def shard_ports(host: str, port: int, count: int) -> list[int]:
    """port .. port+count-1, or with port 0 as many free ones."""
    if port:
        return [port + i for i in range(count)]
    held = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host if host not in _WILDCARD else "", 0))
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def launch_local_shards(argv: list[str], args) -> int:
    """Runs K shards here until every one exits; returns the worst exit status (a shard that fails stops the rest)."""
    count = args.shards
    ports = shard_ports(args.host, args.port, count)
    host = advertised_host(args.host)
    addresses = ",".join(f"{host}:{p}" for p in ports)
    env = dict(os.environ, **{SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_hex(32)})
    scratch = Path(tempfile.mkdtemp(prefix="diloco-shards-"))
    children = []
    dies_with_us = child_dies_with(os.getpid())  # a launcher SIGKILLed (diloco-sim ending a failed run) takes its shards

    def spawn(i: int, resume: bool = False) -> subprocess.Popen:
        extra = ["--shard", str(i), "--shard-addresses", addresses, "--port", str(ports[i]),
                 "--port-file", str(scratch / f"port-{i}")]
        if args.http_port > 0:
            extra += ["--http-port", str(args.http_port + i)]
        if i and args.http_port_file:
            extra += ["--http-port-file", str(scratch / f"http-{i}")]
        if args.report:  # each shard's part; the run's report is put together from them at the end (write_run_report)
            extra += ["--report", shard_report(args.report, i)]
        if resume:
            extra.append("--resume")
        return subprocess.Popen([sys.executable, "-m", "coordinator", *argv, *extra], env=env, preexec_fn=dies_with_us)

    children.extend(spawn(i) for i in range(count))
    log.info("started %d coordinator shards at %s", count, addresses)
    stopping: list[int] = []  # the signal the launcher was stopped with: its shards' deaths are not restarted then
    stop = _forward_signals(children, stopping)
    restart = (lambda i: spawn(i, resume=True)) if args.checkpoint else None
    try:
        code = _wait(children, scratch, args.port_file, count, addresses, restart, stopping)
    finally:
        stop()
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    if args.report:
        write_run_report(args.report, count)
    return code


def shard_report(path: str, index: int) -> str:
    """Where shard index of `serve --shards K --report PATH` writes its own report."""
    return f"{path}.shard-{index}"


def merged_report(reports: list[dict]) -> dict:
    """The run's report from its shards' (leader first): the leader's, whose rounds are the run's already, with the
    model's checksum and each island's being the shards' joined in shard order (diloco/shardmap.py join_checksums),
    and the calls refused by every shard, by reason."""
    from diloco.shardmap import join_checksums  # here: it imports torch, which the launcher needs nowhere else

    leader = reports[0]
    if len(reports) == 1:
        return leader
    refusals: dict[str, int] = {}  # each shard refuses its own part of a call: every shard's count
    for r in reports:
        for reason, n in r.get("events", {}).get("refusals", {}).items():
            refusals[reason] = refusals.get(reason, 0) + n
    events = dict(leader.get("events", {}), refusals=refusals)
    return dict(leader, checksum=join_checksums([r["checksum"] for r in reports]), events=events,
                islands={i: join_checksums([r["islands"].get(i, "") for r in reports]) for i in leader["islands"]})


def write_run_report(path: str, count: int) -> None:
    """PATH: the run's report, once every shard wrote its own (PATH.shard-I)."""
    parts = [Path(shard_report(path, i)) for i in range(count)]
    missing = [i for i, p in enumerate(parts) if not p.exists()]
    if missing:
        log.warning("no run report at %s: shards %s wrote none (they failed); the others' parts are at %s.shard-I", path,
                    missing, path)
        return
    Path(path).write_text(json.dumps(merged_report([json.loads(p.read_text()) for p in parts]), indent=2))


def _wait(children: list[subprocess.Popen], scratch: Path, port_file: str | None, count: int, addresses: str,
          restart=None, stopping: list[int] = ()) -> int:
    """Waits for every shard; restart(i): shard i started again with --resume (None: a killed shard stops the rest)."""
    told = False
    left = {"killed": [MAX_RESTARTS] * len(children), "rolled back": [MAX_ROLL_BACKS] * len(children)}
    while True:
        codes = [c.poll() for c in children]
        for i, c in enumerate(codes):
            kind = "killed" if c is not None and c < 0 else "rolled back" if c == ROLL_BACK_EXIT else None
            if kind is not None and restart is not None and left[kind][i] and not stopping:
                left[kind][i] -= 1
                why = f"was killed (signal {-c})" if c < 0 else "stopped to resume with the others"
                log.warning("coordinator shard %d %s; starting it again with --resume (%d such restart(s) left)", i, why,
                            left[kind][i])
                children[i] = restart(i)
                codes[i] = None
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return max(failed)
        if all(c == 0 for c in codes):
            return 0
        if not told and all((scratch / f"port-{i}").exists() for i in range(count)):
            told = True  # every shard serves: whoever waits on the port file can reach them all
            if port_file:  # every shard's address first: whoever reads the port file may want them all
                Path(f"{port_file}.shards").write_text("\n".join(a for a in addresses.split(",")) + "\n")
                Path(port_file).write_text((scratch / "port-0").read_text())
        time.sleep(0.2)


def _forward_signals(children: list[subprocess.Popen], stopping: list[int]):
    def forward(signum, frame):
        stopping.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def launcher_index(environ: Mapping[str, str] = os.environ, hostname: str | None = None) -> tuple[int, int] | None:
    """(index, count) from the launcher's environment, or None outside one. A StatefulSet gives only the
    ordinal (its hostname's "-N" suffix): the count is then None's job, given by --shards."""
    for rank, size in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in environ and size in environ:
            return int(environ[rank]), int(environ[size])
    if "KUBERNETES_SERVICE_HOST" in environ:
        m = re.search(r"-(\d+)$", hostname or socket.gethostname())
        if m:
            return int(m.group(1)), 0
    return None


def shard_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    raw = environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(raw)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(f"a coordinator of several shards needs the shards' shared secret: set {SECRET_ENV} to the same "
                          "32+ hex digits on every shard (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`); "
                          "`serve --shards K` on one machine makes one itself")
    return secret
