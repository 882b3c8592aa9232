"""What the coordinator does around each round's close besides the round itself: hooks registered at start.

coordinator/rounds.py FragmentRounds.apply calls them at its points (rounds.py Hooks: idle, closing, stepping,
settling, closed); CoordinatorState registers these (coordinator/state.py), the process around it the run log, the
checkpoint and health (coordinator/server.py). Each takes the fragment first, then what the point gives it.

- stepping: the eager mean (streaming.eager), before the outer step overwrites it.
- settling, holding the round's condition: the ledger's settlement (a token corpus), then membership (who sat the
  round out; the late ones folded).
- closing / closed: the summaries (the run's last after every other fragment's), evaluation before them, memory
  sampled around the close; idle: the allocator's slack handed back while pushes arrive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.ledger import DataLedger
from coordinator.loglines import round_closed_line, run_summary_line
from coordinator.memory import FreedMemory, MemoryPeaks
from coordinator.rounds import Closed, Closing, FragmentRounds, Hooks
from diloco.wire.messages import tensor_chunks

# The round-closed and run-finished lines keep the logger they have always been on (log filters and tests name it).
log = logging.getLogger("coordinator.state")


def eager_mean(f: FragmentRounds, closed: Closed) -> None:
    """Eager updates: islands build their provisional update from the round's mean (downlink codec, no feedback),
    encoded before the step, which may overwrite it (the accumulator is reset after it)."""
    f.mean_chunks = [] if closed.skipped else list(tensor_chunks(f.accumulator.mean(), f.publication.codec,
                                                                   f.cfg.wire.chunk_bytes))


def settle_ledger(ledger: DataLedger) -> Callable[[FragmentRounds, Closed], None]:
    """The token corpus's account of the round: the kept contributions' samples folded (coordinator/ledger.py)."""

    def settle(f: FragmentRounds, closed: Closed) -> None:
        closed.summary.data.CopyFrom(ledger.settle(f.index, [c.samples for _, c in closed.kept], f.members.live()))

    return settle


def membership(f: FragmentRounds, closed: Closed) -> None:
    """Who sat the round out (the idle leave the run) and the late contributions folded (coordinator/membership.py)."""
    f.members.after_round(f.round_opened_at, [i for i, _ in closed.closing.contributions])
    f.members.events.late_folded += sum(1 for _, c in closed.kept if c.staleness)


class Evaluation:
    """The global parameters' eval loss once per wave (after fragment 0, the last of a wave to sync) and at the end;
    downstream task scores every eval.tasks_every_rounds rounds. state: the CoordinatorState (its evaluators, its
    read locks and readers)."""

    def __init__(self, state) -> None:
        self.state = state

    def __call__(self, f: FragmentRounds, closed: Closed) -> None:
        state, summary, finisher = self.state, closed.summary, closed.run_finished
        if state.evaluate and (finisher or (f.index == 0 and summary.round % state.cfg.eval.every_rounds == 0)):
            started = time.perf_counter()
            with state.reading_all():
                summary.eval_loss = state.read_whole(state.evaluate)
            summary.eval_s = time.perf_counter() - started
        every = state.cfg.eval.tasks_every_rounds
        if state.tasks and (finisher or (f.index == 0 and (summary.round + 1) % every == 0)):
            started = time.perf_counter()
            with state.reading_all():
                summary.task_scores.update(state.read_whole(state.tasks))
            summary.eval_s += time.perf_counter() - started


class Summaries:
    """Appends each round's summary to state.summaries (what watchers and the dashboard read): the run's last one
    after every other fragment's, merged with the other shards' parts on a leading shard, logged."""

    def __init__(self, state) -> None:
        self.state = state
        self.pending = 0  # rounds closing whose summary is not in state.summaries yet (read holding state.cond)

    def closing(self, f: FragmentRounds, closing: Closing) -> None:
        with self.state.cond:
            self.pending += 1

    def closed(self, f: FragmentRounds, closed: Closed) -> None:
        state, summary, finisher = self.state, closed.summary, closed.run_finished
        summary.initial_eval_loss = state.initial_eval_loss
        if state.followers is not None:  # a leading shard: the round's summary is the run's, every shard's part in it
            state.followers.merge(summary)
        # Before anyone waiting for the round learns of it: they may read the log next.
        log.info("%s", round_closed_line(f.label, summary, f.last_close_reason))
        with state.cond:
            if finisher:
                state.cond.wait_for(lambda: self.pending == 1)
            state.summaries.append(summary)
            self.pending -= 1
            state.cond.notify_all()
        if finisher:
            with state.cond:
                summaries = list(state.summaries)
            log.info("%s", run_summary_line(summaries, state.checksum))


class MemorySampling:
    """The most each part of memory held (coordinator/memory.py MemoryPeaks), sampled before the fold (the round's
    pushes in the pool, the last round's values maybe held) and after the close (the outer step, the publication and
    the summary); the allocator's slack handed back after each close and, while pushes arrive, at most once a second."""

    def __init__(self, measure: Callable[..., dict[str, int]], spools) -> None:
        self.peaks, self.freed, self.spools = MemoryPeaks(measure), FreedMemory(), spools

    def idle(self, f: FragmentRounds) -> None:
        if self.spools.used:  # pushes arrived: the slack their buffers leave mid-round
            self.freed.trim(at_most_every_s=1.0)

    def closing(self, f: FragmentRounds, closing: Closing) -> None:
        self.peaks.sample((f.index, closing))

    def closed(self, f: FragmentRounds, closed: Closed) -> None:
        self.peaks.sample()
        self.freed.trim()


def register(hooks: Hooks, state) -> MemorySampling:
    """The state's hooks, in the order they run at each point; returns the memory sampling (its peaks are reported)."""
    summaries, memory = Summaries(state), MemorySampling(state.memory, state.spools)
    if state.cfg.streaming.eager:
        hooks.stepping.append(eager_mean)
    if state.ledger is not None:
        hooks.settling.append(settle_ledger(state.ledger))
    hooks.settling.append(membership)
    hooks.idle.append(memory.idle)
    hooks.closing += [summaries.closing, memory.closing]
    hooks.closed += [Evaluation(state), summaries.closed, memory.closed]
    return memory
