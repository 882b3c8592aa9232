"""Runs of one island of a given kind through the round protocol's hard cases, for tests/test_island_parity.py.

    python tests/island_scenarios.py SCENARIO WORKDIR KIND

KIND is 1 (one rank), 1x2 (one replica group of 2 FSDP ranks) or 2x2 (two
groups of 2). A coordinator runs in this process, the island as
`python -m islands join` processes, and a puppet island driven from here
decides when rounds may close. Every wait is bounded; everything started here
is stopped on the way out. torchft's servers bind every interface, so the tests
start this inside a network namespace with only loopback (unshare -rn).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import one_island_config, tiny_config  # noqa: E402
from coordinator.server import start_coordinator  # noqa: E402
from diloco.checkpoint import CheckpointStore  # noqa: E402
from fsdp_scenarios import SHARDED_FLAGS, Puppet, Run, events, wait_until  # noqa: E402

log = logging.getLogger("scenario")

KINDS = {
    "1": [],
    "1x2": ["--nproc-per-node", "2", "--replica-groups", "1"],
    "2x2": ["--nproc-per-node", "2", "--replica-groups", "2", "--max-restarts", "0"],
}


def protocol(workdir: Path, kind: str) -> None:
    """Round by round, with a puppet island beside it (rounds.min_islands=1):

    0. the puppet alone; the island joins after, while round 1 is open;
    1. plain;
    2. the coordinator is stopped after the island's contribution came and restarted from its
       checkpoint: the island pushes again;
    3. the island pushes 8 s late, after the round's (shortened) deadline closed it without the
       island: its push is refused (ROUND_CLOSED) and it resyncs;
    4. the island's copy of theta_global is perturbed before the pull: the result fails the
       checksum and the island resyncs;
    5. plain; the run ends, the island leaves with its stats;
    then a second island of the same kind joins the finished run and exits quietly.
    """
    # The puppet closes round 0 alone: the run's first outer step with one contribution (robust.first_quorum 1).
    cfg = one_island_config(
        "model.n_layers=2", "inner.steps_per_round=3", "rounds.rounds=6", "rounds.min_islands=1", "data.shards=2",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30", "wire.downlink_codec='int8'",
        f"checkpoint.url='{workdir / 'coordinator-ckpt'}'", "checkpoint.every_rounds=1",
    )
    run = Run(workdir, cfg, deadline_s=240)
    reports = workdir / "island"
    flags = [*KINDS[kind], "--report-dir", str(reports), *SHARDED_FLAGS]
    faults = "hold-before-push:round=3,delay=8;perturb-before-pull:round=4"
    puppet = None
    try:
        puppet = Puppet(run.coordinator.port, cfg)
        puppet.push(0)
        wait_until(run, "round 0 to close", lambda: run.coordinator.state.round == 1)
        run.island("island", *flags, env={"DILOCO_FAULT": faults})
        state = lambda: run.coordinator.state  # noqa: E731 - the coordinator is replaced in round 2
        island = wait_until(run, "the island to join", lambda: next((i for i in state().islands if i != puppet.island_id), None))
        run.notes.update(island=island, puppet=puppet.island_id, kind=kind)

        def contributed(round_: int) -> bool:
            s = state()
            with s.cond:
                c = s.fragments[0].contributions.get(island)
                return s.round == round_ and c is not None and c.state == "complete"

        for round_ in range(1, cfg.rounds.rounds):
            if round_ == 3:
                # Round 3 closes at its deadline with the puppet alone: shortened in place for this round only.
                usual, state().cfg.rounds.deadline_s = state().cfg.rounds.deadline_s, 3.0
                puppet.push(3)
                wait_until(run, "round 3 to close at its deadline", lambda: state().round == 4, timeout_s=60)
                state().cfg.rounds.deadline_s = usual
                continue
            wait_until(run, f"the island's contribution to round {round_}", lambda: contributed(round_), timeout_s=120)
            if round_ == 2:
                store = CheckpointStore(str(workdir / "coordinator-ckpt"))
                wait_until(run, "the coordinator's checkpoint of round 1", lambda: 2 in store.steps())
                port = run.coordinator.port
                run.coordinator.stop(0)
                run.coordinator = start_coordinator(cfg, "127.0.0.1", port, spool_dir=str(workdir / "spool2"), resume=True)
                wait_until(run, "the island to push round 2 again", lambda: contributed(2), timeout_s=120)
            puppet.push(round_)
            wait_until(run, f"round {round_} to close", lambda: state().round > round_)
        run.finish()
        late = subprocess.run(
            [sys.executable, "-m", "islands", "join", "--coordinator", f"127.0.0.1:{run.coordinator.port}",
             "--config", str(run.config_path), *KINDS[kind], *SHARDED_FLAGS],
            env=run.env, cwd=ROOT, capture_output=True, text=True, timeout=run.left(),
        )
        result = json.loads((workdir / "result.json").read_text())
        result["late"] = {"code": late.returncode, "output": (late.stdout + late.stderr)[-3000:]}
        (workdir / "result.json").write_text(json.dumps(result, indent=1))
    finally:
        if puppet is not None:
            puppet.close()
        run.close()


def streaming(workdir: Path, kind: str, fault: str = "") -> None:
    """Streaming DiLoCo (P = 2, tau = 1, alpha = 0.5) on an island of this kind.

    Without a fault the island is alone in the run (the test replays the same arithmetic in process).
    With fault "kill-pusher" a puppet island holds each fragment's round open until the island's
    contribution to it is in, and in fragment 1's round 1 the pushing group 0 is SIGKILLed at the
    landing, before reporting its push (DILOCO_FAULT die-before-land): the exchange is in flight, the
    group that is then rank 0 of the quorum takes the push over, and group 0 comes back and heals.
    """
    faulty = fault == "kill-pusher"
    cfg = (tiny_config if faulty else one_island_config)(  # without the fault the island is alone in the run
        "model.n_layers=2", "inner.steps_per_round=4", "rounds.rounds=4", f"rounds.min_islands={2 if faulty else 1}",
        f"data.shards={2 if faulty else 1}", "streaming.fragments=2", "streaming.tau=1", "streaming.alpha=0.5",
        "rounds.deadline_s=120", "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
    )
    run = Run(workdir, cfg, deadline_s=200)
    reports = workdir / "island"
    puppet = Puppet(run.coordinator.port, cfg) if faulty else None
    try:
        fault_env = {"DILOCO_FAULT": "die-before-land:group=0,round=1,fragment=1"} if faulty else {}
        run.island("island", *KINDS[kind], "--max-restarts", "2", "--report-dir", str(reports), *SHARDED_FLAGS, env=fault_env)
        state = run.coordinator.state
        others = {puppet.island_id} if puppet else set()
        island = wait_until(run, "the island to join", lambda: next((i for i in state.islands if i not in others), None))
        run.notes.update(island=island, kind=kind, fault=fault)
        if faulty:
            due = [0] * cfg.streaming.fragments  # the next round of each fragment the puppet pushes

            def ready():
                with state.cond:
                    for f, frag in enumerate(state.fragments):
                        c = frag.contributions.get(island)
                        if frag.round == due[f] < cfg.rounds.rounds and c is not None and c.state == "complete":
                            return (f,)
                return None

            while any(r < cfg.rounds.rounds for r in due):
                (f,) = wait_until(run, f"the island's contributions (next rounds {due})", ready)
                if (f, due[f]) == (1, 1):
                    # Group 0 dies at this landing; the round stays open (the puppet holds it) until group 0
                    # is back, so that it joins the next quorum and heals, however slowly it restarts.
                    wait_until(run, "group 0 to restart", lambda: all(
                        any(e["event"] == "up" for e in events(reports, f"g0-r{r}-a1")) for r in (0, 1)), timeout_s=150)
                puppet.push(due[f], f)
                due[f] += 1
        run.finish()
    finally:
        if puppet is not None:
            puppet.close()
        run.close()


SCENARIOS = {"protocol": protocol, "streaming": streaming}

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [scenario] %(levelname)s %(name)s: %(message)s")
    t0 = time.monotonic()
    SCENARIOS[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
    log.info("scenario %s done in %.1fs", sys.argv[1], time.monotonic() - t0)
