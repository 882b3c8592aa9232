"""Fuzzing the coordinator (issue 15, item 5) beside a legitimate two-island run.

A coordinator serves mutual TLS on 127.0.0.1 with a CA that signed three island credentials: "east"
and "west" (the legitimate islands, run in threads of this process) and "fuzzer". The fuzzer joins
as its own island, then for a bounded count of calls and seconds sends every RPC of the .proto
random and mutated requests, push streams, raw bytes, call metadata and short deadlines
(tests/probes/fuzz_gen.py), through generic calls that take bytes (no island code). Each answer must
be explained: a typed Refusal with its reason's status (diloco/wire/refusal.py), or gRPC's own answer to
input that never reached the servicer (too large, unparseable, bad metadata, the client's deadline
or cancel). UNKNOWN (an exception in a servicer) is what it hunts for. It never pushes a chunk of
one reserved parameter, so it never completes a contribution: the legitimate run must end with
each island on the coordinator's parameters and the same aggregate as the same run undisturbed.

Run from the repository root:  python -m tests.probes.fuzz --seed 0   (about half a minute on 2 cores)
Prints the calls tried per RPC and status, then the checks; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # gRPC core logs each invalid metadata key it refuses
import grpc  # noqa: E402  (after GRPC_VERBOSITY, which gRPC reads as it loads)
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from coordinator.server import start_coordinator  # noqa: E402
from diloco.security import credentials  # noqa: E402
from diloco.config import RunConfig, load_config  # noqa: E402
from diloco.v1 import diloco_pb2 as pb  # noqa: E402
from diloco.v1 import diloco_pb2_grpc as pb_grpc  # noqa: E402
from tests.probes.fuzz_client import SERVICE, TIMEOUT_S, Fuzzer  # noqa: E402

LEGIT = ("east", "west")  # the legitimate islands' credentials, and their ids in the run (their certificates' names)
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_seq_len=32",
        "data.seq_len=32", "inner.batch_size=4", "inner.steps_per_round=2", "eval.batches=0", "wire.chunk_bytes=4096"]
# Rounds wait for every live member until the deadline, and the fuzzer is one that never completes (until
# it is removed for idleness and comes back on probation). It rejoins after each removal and fuzzes Join
# itself: at the default 30 joins a minute it would spend most of a run outside it, where no deep path is.
RUN = ["rounds.min_islands=2", "rounds.deadline_s=3", "rounds.lease_s=30", "limits.joins_per_minute=600"]


# --- the legitimate run ------------------------------------------------------------------------


class LegitRun:
    """The honest islands, one thread each in this process, under their own credentials."""

    def __init__(self, cfg: RunConfig, address: str, ca: Path):
        from islands.world import IslandWorld

        self.cfg, self.address, self.ca = cfg, address, ca
        self.world = IslandWorld.init("cpu")
        self.clients: list = []
        self.islands: list = []
        self.results: dict[str, object] = {}
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def join(self) -> None:
        """Joined one after the other before any runs: the same island ids (and data shards) in every run."""
        from islands.client import CoordinatorClient
        from islands.island import Island

        for name in LEGIT:
            client = CoordinatorClient(self.address, connect_timeout_s=30, tls=credentials.island_files(self.ca, name))
            self.clients.append(client)
            self.islands.append(Island(self.cfg, self.world, client, client.join(self.cfg.digest())))

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._run, args=(n, i), daemon=True) for n, i in zip(LEGIT, self.islands)]
        for thread in self.threads:
            thread.start()

    def _run(self, name: str, island) -> None:
        try:
            self.results[name] = island.run()
        except Exception as e:  # noqa: BLE001 - reported as a failed check
            self.errors.append(f"{name}: {type(e).__name__}: {e}")

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.world.shutdown()


@dataclass
class RunOutcome:
    checksum: str = ""  # the coordinator's global parameters at the end
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _serving(channel: grpc.Channel, coordinator) -> bool:
    """Still up: the server's health is SERVING (the service's turns NOT_SERVING when the run finishes) and a
    plain fetch streams the coordinator's parameters."""
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        header = [m.header for m in pb_grpc.CoordinatorStub(channel).FetchParameters(pb.FetchRequest(), timeout=TIMEOUT_S)][0]
    except grpc.RpcError:
        return False
    return health.status == health_pb2.HealthCheckResponse.SERVING and header.checksum == coordinator.state.checksum


def one_run(cfg: RunConfig, ca: Path, spool: Path, fuzzer_args: dict | None) -> tuple[RunOutcome, Fuzzer | None]:
    """The legitimate run on a fresh coordinator, with the fuzzer beside it when fuzzer_args are given."""
    coordinator = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(spool), tls=credentials.coordinator_files(ca))
    address, out, fuzzer, legit = f"127.0.0.1:{coordinator.port}", RunOutcome(), None, None
    try:
        legit = LegitRun(cfg, address, ca)
        legit.join()
        if fuzzer_args is not None:
            legit_ids = list(LEGIT)
            fuzzer = Fuzzer(address, credentials.island_files(ca, "fuzzer"), cfg, legit_ids,
                            lambda i: i in coordinator.state.islands, **fuzzer_args)
            fuzzer.join()
            fuzzer.start()
        legit.start()
        # Generous: a round takes at most its deadline and a few seconds more, however busy the machine.
        bound = 60.0 + (cfg.rounds.deadline_s + 10.0) * cfg.rounds.rounds
        out.checks["the legitimate islands finished"] = legit.wait(bound) and not legit.errors
        if fuzzer is not None:
            fuzzer.stop.set()
            out.checks["the fuzzer's calls all ended"] = fuzzer.wait()
            out.checks["the coordinator served to the end"] = _serving(fuzzer.channel, coordinator)
        out.checksum = coordinator.state.checksum
        out.notes += legit.errors
        _check_run(cfg, coordinator, legit, out)
    finally:
        if fuzzer is not None:
            fuzzer.close()
        out.checks["the coordinator stopped"] = _stop(coordinator)
        if legit is not None:
            legit.close()
    return out, fuzzer


def _stop(coordinator, timeout_s: float = 60.0) -> bool:
    """Stops the coordinator; whether it stopped within timeout_s (one that never does is a finding, not a hung run)."""
    stopper = threading.Thread(target=coordinator.stop, args=(0.5,), daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    return not stopper.is_alive()


def _check_run(cfg: RunConfig, coordinator, legit: LegitRun, out: RunOutcome) -> None:
    ids = sorted(LEGIT)
    results = [legit.results.get(n) for n in LEGIT]
    departed = coordinator.report()["islands"]
    out.checks["each island ends on the coordinator's parameters"] = all(
        r is not None and r.checksum_matches and r.checksum == out.checksum == departed.get(r.island_id) for r in results)
    rounds = [sorted(s.islands) for s in coordinator.state.summaries]
    out.checks["every round folded exactly the legitimate islands"] = rounds == [ids] * cfg.rounds.rounds
    if rounds != [ids] * cfg.rounds.rounds:
        out.notes.append(f"rounds folded {rounds}")


@dataclass
class Report:
    """What one fuzzing session found: calls per (RPC, status, label), the failures, and the checks."""

    tally: Counter  # (rpc, status code name, label) -> calls
    failures: list[str]
    checks: dict[str, bool]
    notes: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def table(self) -> str:
        """Calls per RPC and status (markdown), then per status and label (the refusal's reason, or gRPC's own answer)."""
        codes = sorted({c for _, c, _ in self.tally}, key=lambda c: (c != "OK", c))
        per, labels = Counter(), {c: Counter() for c in codes}
        for (rpc, code, label), n in self.tally.items():
            per[(rpc, code)] += n
            per[("all", code)] += n
            labels[code][label] += n
        lines = ["| RPC | calls | " + " | ".join(codes) + " |", "|---" * (len(codes) + 2) + "|"]
        for rpc in [m.name for m in SERVICE.methods] + ["all"]:
            row = [per[(rpc, code)] for code in codes]
            lines.append(f"| {rpc} | {sum(row)} | " + " | ".join(str(n) for n in row) + " |")
        lines.append("")
        lines += [f"{code}: " + ", ".join(f"{label} {n}" for label, n in labels[code].most_common()) for code in codes]
        return "\n".join(lines)

    def summary(self) -> str:
        checks = [f"{'ok  ' if ok else 'FAIL'} {what}" for what, ok in self.checks.items()]
        return "\n".join([*checks, *(f"  {n}" for n in self.notes), *(f"  unexplained: {f}" for f in self.failures[:20])])


def make_credentials(d: Path) -> Path:
    credentials.create_ca(d)
    credentials.issue_coordinator(d, ["127.0.0.1"])
    for name in (*LEGIT, "fuzzer"):
        credentials.issue_island(d, name)
    return d


def fuzz(cfg: RunConfig, workdir: Path, seed: int = 0, calls: int = 5000, seconds: float = 60.0, threads: int = 2) -> Report:
    """The run fuzzed, then the same run undisturbed; the checks of both and the fuzzer's tally."""
    started = time.monotonic()
    ca = make_credentials(workdir / "tls")
    fuzzed, fuzzer = one_run(cfg, ca, workdir / "spool-fuzzed", {"seed": seed, "calls": calls, "seconds": seconds,
                                                                  "threads": threads})
    quiet, _ = one_run(cfg, ca, workdir / "spool-quiet", None)
    checks = {**fuzzed.checks, **{f"undisturbed: {k}": v for k, v in quiet.checks.items()}}
    checks["every answer explained (no UNKNOWN, each refusal's status its reason's)"] = not fuzzer.failures
    checks["acting as another credential's island refused (NOT_YOURS)"] = any(
        label == "NOT_YOURS" for _, _, label in fuzzer.tally)
    checks["the aggregate equals the undisturbed run's"] = bool(fuzzed.checksum) and fuzzed.checksum == quiet.checksum
    notes = fuzzed.notes + quiet.notes + [f"checksums: fuzzed {fuzzed.checksum[:16]}, undisturbed {quiet.checksum[:16]}"]
    return Report(fuzzer.tally, fuzzer.failures, checks, notes, time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calls", type=int, default=5000, help="at most this many fuzz calls")
    parser.add_argument("--seconds", type=float, default=60.0, help="for at most this long (and no longer than the run)")
    parser.add_argument("--threads", type=int, default=2, help="fuzzing threads")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the legitimate run (the fuzzing lasts as long)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another config override, e.g. robust.check_claims=false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the coordinator logs every refusal; the table says it all
    try:
        cfg = load_config(None, TINY + RUN + [f"rounds.rounds={args.rounds}", *args.set])
    except ValueError as e:
        parser.error(f"--set: {e}")
    with tempfile.TemporaryDirectory(prefix="diloco-fuzz-") as d:
        report = fuzz(cfg, Path(d), args.seed, args.calls, args.seconds, args.threads)
    calls = sum(report.tally.values())
    print(f"{calls} fuzz calls (seed {args.seed}, {args.threads} threads) beside a {args.rounds}-round two-island run "
          f"over mutual TLS; {report.seconds:.0f}s in all\n")
    print(report.table() + "\n")
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
