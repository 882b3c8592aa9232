"""One member with a stolen key: the final eval loss with a compromised third island against a third honest one.

The embedded default (the demo's model, 4-bit + zstd both ways, mutual TLS, the
norm guard and the claim check on), 12 rounds, 3 islands. Islands 0 and 1 are
honest `diloco-island join` processes; island 2 is the same process, honest (the
baseline, one row per seed: the seed-to-seed spread) or an attacker whose push is
changed within the protocol's rules:

- ranks: joins declaring 4096 ranks and claims 4096x its tokens (item 1);
- round0: pushes 1,000x its pseudo-gradient in round 0, beside the others (item 2);
- lone: joins first and pushes 1,000x its pseudo-gradient in round 0 before the others have joined, with the
  default rounds.min_islands (1) (item 2);
- lrpeak: says its steps sat at the inner lr's peak and pushes 19.8x its
  pseudo-gradient (item 3);
- direction: pushes -2.7x its pseudo-gradient every round (item 4).

Prints each run's final eval loss, the rounds the attacker was clipped in and
how it was refused (if it was).

    python -m tests.probes.member_attacks [--modes ranks,round0,lrpeak,direction] [--seeds 0,1]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diloco.config import load_config
from islands.sim.simulation import Simulation

ROOT = Path(__file__).resolve().parents[2]  # the repository root, where `-m tests.probes.member_attacks` resolves
MODES = ("ranks", "round0", "lone", "lrpeak", "direction")
SCALE = {"round0": 1000.0, "lone": 1000.0, "lrpeak": 19.8, "direction": -2.7}
LONE_PUSHED = "attacker pushed round 0"


class AttackedSimulation(Simulation):
    """The simulation with island 2 started through this file as the attacker (mode) or as itself ("honest")."""

    def __init__(self, *args, mode: str = "honest", **kwargs):
        super().__init__(*args, **kwargs)
        self.mode = mode

    def start(self) -> None:
        if self.mode != "lone":
            return super().start()
        # The attacker joins first and pushes round 0 before the honest islands start (bounded: 300 s).
        self.started = time.monotonic()
        self.start_coordinator()
        self.start_island(2)
        log, deadline = self.workdir / "island-2.log", time.monotonic() + 300
        while time.monotonic() < deadline and self.island_procs[2].poll() is None:
            if log.exists() and LONE_PUSHED in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        self.start_island(0)
        self.start_island(1)

    def failed_island(self) -> str | None:
        # The attacker's process exits with an error when it is refused: the honest islands' run goes on.
        return None if self.mode != "honest" else super().failed_island()

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        if log_name != "island-2.log" or self.mode == "honest":
            return super()._spawn(args, log_name)
        with open(self.workdir / log_name, "a") as log_file:
            return subprocess.Popen([sys.executable, "-m", "tests.probes.member_attacks", "--attacker", self.mode, "--", *args[1:]],
                                    cwd=ROOT, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)


def attack(mode: str, join_argv: list[str]) -> None:
    """Runs `diloco-island join` with its push changed as `mode` says (in the attacker's own process)."""
    import torch

    from islands import cli, round as island_round
    from islands.client import CoordinatorClient

    push, join = island_round.push, CoordinatorClient.join

    def changed_push(shard, ex, wire):
        scale = SCALE.get(mode, 1.0) if mode not in ("round0", "lone") or ex.round == 0 else 1.0
        saved = {n: t.detach().clone() for n, t in shard.local.items()}
        with torch.no_grad():  # local' = global - scale x (global - local): the pseudo-gradient scaled
            for n, t in shard.local.items():
                t.copy_((shard.flat_global(n) - scale * (shard.flat_global(n) - t.to("cpu", torch.float32))).view_as(t))
        tokens, first = ex.tokens, ex.first_step
        if mode == "ranks":
            ex.tokens *= 4096
        if mode == "lrpeak":
            ex.first_step = 20  # the tiny preset's warmup ends here: the lr's peak
        try:
            response = push(shard, ex, wire)
            print(f"attacker pushed round {ex.round}", flush=True)
            return response
        finally:
            ex.tokens, ex.first_step = tokens, first
            with torch.no_grad():
                for n, t in shard.local.items():
                    t.copy_(saved[n])

    def changed_join(self, *args, **kwargs):
        if mode == "ranks":
            kwargs["ranks"] = 4096
        return join(self, *args, **kwargs)

    island_round.push = changed_push
    CoordinatorClient.join = changed_join
    cli.main(join_argv)


def run(mode: str, seed: int, workdir: Path) -> dict:
    # min_islands 2: an attacker refused at join leaves a run of the two honest islands; lone runs the defaults
    # (min_islands 1, robust.first_quorum 2).
    min_islands = 1 if mode == "lone" else 2
    cfg = load_config(None, ["wire.codec=e3m0", "wire.zstd=true", "rounds.rounds=12", f"rounds.min_islands={min_islands}",
                             "data.shards=3", f"seed={seed}"])
    sim = AttackedSimulation(cfg, 3, workdir, mode=mode)
    try:
        sim.start()
        for _ in sim.watch(900):
            pass
        try:
            report = sim.finish(900).report
        except RuntimeError:  # the attacker's process exits non-zero when it is refused; the run's report stands
            report = json.loads(sim.report_path.read_text())
    except TimeoutError as e:
        return {"mode": mode, "seed": seed, "failed": str(e)}
    finally:
        sim.close()
    attacker = island_id(workdir / "island-2.log")
    return {
        "mode": mode, "seed": seed, "eval": report["rounds"][-1]["eval_loss"], "initial": report["initial_eval_loss"],
        "clipped": sum(attacker in r.get("clipped", []) for r in report["rounds"]),
        "in_rounds": sum(attacker in r["islands"] for r in report["rounds"]),
        "refusals": report["events"]["refusals"],
    }


def island_id(log: Path) -> str:
    """The id the coordinator gave the island of this log (ids follow the order of joining, not the sim's index)."""
    found = re.search(r"\b(island-\d+) (?:step|finished)", log.read_text(errors="replace"))
    return found.group(1) if found else ""


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--attacker":
        attack(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
        return
    p = argparse.ArgumentParser(prog="member_attacks", description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seeds", default="0,1", help="honest baseline seeds (the attacks run on the first)")
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    modes, seeds = [m for m in args.modes.split(",") if m], [int(s) for s in args.seeds.split(",")]
    if any(m not in MODES for m in modes) or not seeds:
        p.error(f"--modes of {', '.join(MODES)}; --seeds a comma-separated list")
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-member-attacks-") as work:
        for seed in seeds:
            rows.append(run("honest", seed, Path(work) / f"honest-{seed}"))
        for mode in modes:
            rows.append(run(mode, seeds[0], Path(work) / mode))
    print(f"{'third island':<14} {'seed':>4} {'final eval':>10} {'in rounds':>9} {'clipped':>7}  refusals")
    for row in rows:
        if "failed" in row:
            print(f"{row['mode']:<14} {row['seed']:>4}  failed: {row['failed']}")
            continue
        print(f"{row['mode']:<14} {row['seed']:>4} {row['eval']:>10.4f} {row['in_rounds']:>9} {row['clipped']:>7}  "
              f"{json.dumps(row['refusals'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
