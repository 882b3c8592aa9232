"""Failure injection for one-node runs: SIGKILL islands and the coordinator, restart them, and count the cost.

Islands restart with --resume from their own checkpoints and the coordinator
with --resume from its last committed checkpoint, on the same port, so the
survivors reconnect with no manual step.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diloco.config import RunConfig
from islands.sim.simulation import RoundPrinter, SimResult, Simulation


@dataclass
class ChaosPlan:
    island_every: int = 3  # kill a random island after every this many rounds
    coordinator_at: int = 4  # kill the coordinator once, after this round (-1: never)
    restart_after_s: float = 1.0
    kill_delay_s: tuple[float, float] = (0.2, 1.5)  # kill this long into the next round
    seed: int = 0


@dataclass
class ChaosLog:
    kills: list[tuple[str, int, float]] = field(default_factory=list)  # (who, after round, time)
    recovery_s: list[float] = field(default_factory=list)


def parse_chaos(text: str) -> ChaosPlan:
    """`EVERY[:COORDINATOR_AT]`, as diloco-sim --chaos takes it."""
    every, _, coordinator = text.partition(":")
    try:
        plan = ChaosPlan(island_every=int(every), coordinator_at=int(coordinator) if coordinator else -1)
    except ValueError:
        raise ValueError(f"{text!r} is not EVERY[:COORDINATOR_AT] with whole numbers, e.g. 3:4") from None
    if plan.island_every < 1 or (coordinator and plan.coordinator_at < 0):
        raise ValueError(f"{text!r}: EVERY must be at least 1 and COORDINATOR_AT at least 0")
    return plan


def describe(chaos: ChaosLog) -> str:
    kills = ", ".join(f"{who} after round {after}" for who, after, _ in chaos.kills) or "nothing"
    back = ", ".join(f"{s:.1f}s" for s in chaos.recovery_s) or "-"
    return f"chaos: killed {kills}; all islands back in a round after {back}"


def run_chaos(
    cfg: RunConfig, islands: int, workdir: Path, plan: ChaosPlan, timeout_s: float = 900.0, echo=print,
    threads: int = 1, per_island: bool = False,
) -> tuple[SimResult, ChaosLog]:
    rng = random.Random(plan.seed)
    sim = Simulation(cfg, islands, workdir, threads, checkpoints=True)
    chaos = ChaosLog()
    pending: list[float] = []  # kill times still waiting for a full round after them
    lock = threading.Lock()
    timers: list[threading.Thread] = []

    def kill_later(who: str, after_round: int) -> None:
        def act() -> None:
            time.sleep(rng.uniform(*plan.kill_delay_s))
            with lock:
                now = time.monotonic()
                if who == "coordinator":
                    sim.kill_coordinator()
                    chaos.kills.append((who, after_round, now))
                    time.sleep(plan.restart_after_s)
                    sim.start_coordinator(resume=True)
                else:
                    i = int(who.split("-")[1])
                    sim.kill_island(i)
                    chaos.kills.append((who, after_round, now))
                    time.sleep(plan.restart_after_s)
                    sim.start_island(i, resume=True)
                pending.append(now)

        t = threading.Thread(target=act, daemon=True)
        timers.append(t)
        t.start()

    coordinator_killed = False
    # The next island kill is due after this round; it waits while an earlier kill is still under way
    # (on a fast machine several rounds close during one), rather than being skipped.
    island_due = plan.island_every - 1
    try:
        sim.start()
        printer = RoundPrinter(echo, per_island, cfg.streaming.fragments)
        last = cfg.rounds.rounds - 1
        for summary in sim.watch(timeout_s):
            note = ""
            with lock:
                now = time.monotonic()
                if len(summary.islands) == islands and pending:
                    chaos.recovery_s.extend(now - t for t in pending)
                    pending.clear()
            # No kill in the last three rounds: a restarted process needs a round or two to be back
            # before the run ends (a kill that waited for an earlier one could otherwise land there).
            if summary.round < last - 2 and not any(t.is_alive() for t in timers):
                if 0 <= plan.coordinator_at <= summary.round and not coordinator_killed:
                    coordinator_killed = True
                    kill_later("coordinator", summary.round)
                    note = "-> killing the coordinator"
                elif summary.round >= island_due:
                    island_due = summary.round + plan.island_every
                    who = f"island-{rng.randrange(islands)}"
                    kill_later(who, summary.round)
                    note = f"-> killing {who}"
            printer.print(summary, note)
        for t in timers:
            t.join(30)
        return sim.finish(timeout_s), chaos
    finally:
        sim.close()
