"""Who trains on which samples: leases of the data stream's positions, and the account of what was folded.

With a token corpus the run reads its samples through positions 0, 1, 2, ...
(diloco/data/samples.py: position p is a sample of epoch p // n). The ledger leases
islands ranges of positions that nobody else gets: an island asks for its
lease number k (every rank and replica group of an island asks, and gets the
same answer), trains its inner steps on the positions in order, and names the
positions each pushed contribution was trained on. At a push the ledger
checks that they were leased to the island and are not folded yet; at the
close it records them as folded into that fragment.

So a position is folded at most once per fragment whatever islands do: a
position is leased once (the cursor only moves forward; positions handed
back untrained at leave are leased again), and a push naming positions
already folded, or not its own, is refused (NOT_LEASED). Positions trained
for a round that was then discarded are lost, never trained again; the
account says how many.

The ledger is saved with the coordinator's checkpoints. After a restart from
an older checkpoint it leases again from the checkpoint's cursor; what an
island trained on a lease the checkpoint does not know is refused at its push
(the island resyncs), so a position reaches the aggregate at most once even
then.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from diloco.pace import max_round_steps
from diloco.wire.refusal import Reason, Refused
from diloco.v1 import diloco_pb2 as pb

Range = tuple[int, int]  # positions [start, stop)

MAX_LEASE = 1 << 26  # positions in one lease: a sanity bound, far above any round's batch


@dataclass(frozen=True)
class LeaseBound:
    """What one island may hold ahead of its training: its ranks' samples of one round (batch x ranks x the most
    inner steps a round holds), and how many rounds of them at most. A lease is at most one round's samples; the
    island's allowance starts at `rounds` rounds' samples, each lease takes its samples from it, and every round the
    run closes (its first fragment's) gives one round's back, up to `rounds` rounds' again: so a member holds at most
    what its ranks train in the rounds ahead, however fast it asks."""

    per_round: int
    rounds: int

    @property
    def most(self) -> int:
        return self.per_round * self.rounds


def lease_bound(cfg, ranks: int) -> LeaseBound:
    """An island's LeaseBound from the run's config and the ranks it declared at join (its certificate's at most):
    inner.batch_size x ranks samples an inner step, the most inner steps a round holds (diloco/pace.py), and
    limits.lease_rounds rounds."""
    return LeaseBound(cfg.inner.batch_size * max(1, ranks) * max_round_steps(cfg), cfg.limits.lease_rounds)


class RangeSet:
    """Disjoint, sorted, coalesced [start, stop) ranges of positions."""

    def __init__(self, ranges: list[Range] | None = None):
        self.starts: list[int] = []
        self.stops: list[int] = []
        for a, b in ranges or []:
            self.add(a, b)

    def __iter__(self):
        return iter(zip(self.starts, self.stops))

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self)

    def overlap(self, a: int, b: int) -> int:
        """Positions of [a, b) in the set."""
        i = bisect.bisect_right(self.stops, a)
        n = 0
        while i < len(self.starts) and self.starts[i] < b:
            n += min(b, self.stops[i]) - max(a, self.starts[i])
            i += 1
        return n

    def add(self, a: int, b: int) -> int:
        """Adds [a, b); returns how many of its positions were in the set already."""
        if a >= b:
            return 0
        already = self.overlap(a, b)
        i = bisect.bisect_left(self.stops, a)  # first range that ends at or after a: it may touch [a, b)
        j = bisect.bisect_right(self.starts, b)  # ranges before j start at or before b
        if i < j:
            a, b = min(a, self.starts[i]), max(b, self.stops[j - 1])
        self.starts[i:j], self.stops[i:j] = [a], [b]
        return already

    def remove(self, a: int, b: int) -> None:
        if a >= b:
            return
        i = bisect.bisect_right(self.stops, a)
        j = bisect.bisect_left(self.starts, b)
        keep: list[Range] = []
        for s, e in zip(self.starts[i:j], self.stops[i:j]):
            if s < a:
                keep.append((s, a))
            if e > b:
                keep.append((b, e))
        self.starts[i:j] = [s for s, _ in keep]
        self.stops[i:j] = [e for _, e in keep]

    def within(self, a: int, b: int) -> list[Range]:
        """The parts of [a, b) in the set."""
        i = bisect.bisect_right(self.stops, a)
        out = []
        while i < len(self.starts) and self.starts[i] < b:
            out.append((max(a, self.starts[i]), min(b, self.stops[i])))
            i += 1
        return out

    def take(self, n: int) -> list[Range]:
        """Removes and returns up to n positions, lowest first."""
        out: list[Range] = []
        while n > 0 and self.starts:
            a, b = self.starts[0], self.stops[0]
            k = min(n, b - a)
            out.append((a, a + k))
            self.remove(a, a + k)
            n -= k
        return out

    def to_list(self) -> list[list[int]]:
        return [[a, b] for a, b in self]


def account_dict(account: pb.DataAccount) -> dict:
    """A DataAccount for the run's JSON report (tokens; `samples` as [start, stop] pairs)."""
    keys = ("leased", "folded", "returned", "lost", "held", "repeated", "folded_this_round", "epoch")
    return {k: getattr(account, k) for k in keys} | {"samples": [[r.start, r.stop] for r in account.samples]}


def ranges_of(protos) -> list[Range]:
    return [(r.start, r.stop) for r in protos]


class DataLedger:
    def __init__(self, epoch_size: int, tokens_per_sample: int, fragments: int = 1):
        self.epoch_size, self.tokens_per_sample = epoch_size, tokens_per_sample
        self.lock = threading.Lock()
        self.cursor = 0  # the next position never leased
        self.free = RangeSet()  # positions handed back untrained: leased again first
        self.leases: dict[str, dict[int, list[Range]]] = {}  # island -> lease index -> ranges
        self.asked: dict[str, int] = {}  # island -> the highest lease index it asked for
        self.sizes: dict[str, int] = {}  # island -> the samples of its last lease
        self.held: dict[str, RangeSet] = {}  # island -> every position leased to it and not handed back
        self.named: dict[str, RangeSet] = {}  # island -> the positions its accepted pushes named (trained)
        # Islands leasing under a bound (the service's): what each may still be leased (LeaseBound). Kept through a
        # leave and a rejoin, so leaving resets nothing; not checkpointed (a restart starts every allowance full).
        self.bounds: dict[str, LeaseBound] = {}
        self.allowance: dict[str, int] = {}
        self.folded = [RangeSet() for _ in range(fragments)]
        self.leased = self.returned = 0
        self.repeated = [0] * fragments

    # --- leasing --------------------------------------------------------------------------

    def lease(self, island_id: str, index: int, samples: int, members: list[str] = (),
              bound: LeaseBound | None = None) -> list[Range]:
        """The island's lease number `index`: the same ranges every time it is asked for, less what has been
        folded or handed back since (an island resumed from an older checkpoint of its own asks again).

        Which positions an island gets must not depend on which island asks first, or two runs of the
        same config (a straight one and a resumed one) would train different islands on different
        data. So the first request for lease number i grants it to every member (`members`, in
        canonical order) whose last request was for i - 1, in that order: islands in step get
        consecutive blocks in id order, whoever asks first.

        With a bound (LeaseBound) a new lease is refused beyond the island's allowance (RATE_LIMITED), and a
        member in step is granted ahead only within its own.
        """
        most = MAX_LEASE if bound is None else min(MAX_LEASE, bound.per_round)
        if index < 0 or not 0 < samples <= most:
            raise Refused(Reason.BAD_REQUEST, f"a lease needs index >= 0 and 1..{most} samples (at most one round of the "
                          f"island's ranks), got {index} and {samples}")
        with self.lock:
            mine = self.leases.setdefault(island_id, {})
            if bound is not None:
                self._refuse_beyond(island_id, 0 if index in mine else samples, bound)
            self.sizes[island_id] = samples
            self.asked[island_id] = max(self.asked.get(island_id, -1), index)
            if index in mine:
                held = self.held.get(island_id, RangeSet())
                live = [p for a, b in mine[index] for p in held.within(a, b)]
                return [q for a, b in live for q in self._unfolded(a, b)]
            in_step = [m for m in members if m != island_id and index not in self.leases.get(m, {})
                       and self.asked.get(m, -1) == index - 1]
            rank = {m: k for k, m in enumerate(members)}
            for m in sorted([*in_step, island_id], key=lambda i: rank.get(i, len(rank))):
                n = self.sizes.get(m, samples)
                if m == island_id or n <= self.allowance.get(m, n):
                    self._grant(m, index, n)
            return mine[index]

    def _refuse_beyond(self, island_id: str, samples: int, bound: LeaseBound) -> None:
        """Refuses a new lease of `samples` beyond the island's allowance (0: a lease it holds, asked again). Caller
        holds lock."""
        self.bounds[island_id] = bound
        left = self.allowance.setdefault(island_id, bound.most)
        if samples > left:
            raise Refused(Reason.RATE_LIMITED, f"{island_id} holds leases for {bound.rounds} rounds of its ranks already "
                          f"({bound.most - left} of {bound.most} samples not yet given back by closed rounds; "
                          f"{samples} more asked): lease as it trains, one round's samples a round")

    def refill(self) -> None:
        """A round of the run closed: every bounded island may be leased one round's samples more, up to its bound."""
        with self.lock:
            for island_id, bound in self.bounds.items():
                self.allowance[island_id] = min(bound.most, self.allowance.get(island_id, bound.most) + bound.per_round)

    def _grant(self, island_id: str, index: int, samples: int) -> None:
        """Caller holds lock."""
        ranges = self.free.take(samples)
        rest = samples - sum(b - a for a, b in ranges)
        if rest:
            ranges.append((self.cursor, self.cursor + rest))
            self.cursor += rest
        self.leases.setdefault(island_id, {})[index] = ranges
        if island_id in self.allowance:
            self.allowance[island_id] -= samples
        held = self.held.setdefault(island_id, RangeSet())
        for a, b in ranges:
            held.add(a, b)
        self.leased += samples

    def release(self, island_id: str, keep_current: bool = False) -> int:
        """An island left or was removed: what it never trained is leased again. That is the leases granted to it
        ahead of its asking, and every position of the others that none of its pushes named and no fragment folded
        (a round it trained for and never pushed, a lease taken and never trained). keep_current: an island that
        may come back as itself (its lease ran out: a restart) keeps the lease it was on, to go on with."""
        with self.lock:
            mine = self.leases.get(island_id, {})
            asked = self.asked.get(island_id, -1)
            ahead = [r for i in [i for i in mine if i > asked] for r in mine.pop(i)]
            kept = RangeSet(mine.get(asked, []) if keep_current else [])
            named = self.named.get(island_id, RangeSet())
            behind = [q for a, b in self.held.get(island_id, RangeSet()) for q in _minus(a, b, named.within(a, b))]
            behind = [q for a, b in behind for q in _minus(a, b, kept.within(a, b))]
            untrained = [q for a, b in ahead + behind for q in self._unfolded(a, b)]
        return self.give_back(island_id, untrained)

    # --- pushes and folds ------------------------------------------------------------------

    def _unfolded(self, a: int, b: int) -> list[Range]:
        """The parts of [a, b) folded into no fragment. Caller holds lock."""
        parts = [(a, b)]
        for folded in self.folded:
            parts = [q for s, e in parts for q in _minus(s, e, folded.within(s, e))]
        return parts

    def check(self, island_id: str, fragment: int, ranges: list[Range], tokens: int) -> None:
        """Refuses a push whose positions are not the island's, are folded already, or do not make its tokens."""
        if not ranges and not tokens:
            return  # pushed with no inner step since its last sync (a recovery path): no samples to account for
        n, end = 0, -1
        for a, b in sorted(ranges):
            if not 0 <= a < b or a < end:
                raise Refused(Reason.BAD_REQUEST, f"sample range [{a}, {b}) is empty, negative or overlaps another")
            n, end = n + b - a, b
        if n * self.tokens_per_sample != tokens:
            raise Refused(Reason.BAD_REQUEST, f"{n} samples of {self.tokens_per_sample} tokens are not the {tokens} tokens claimed")
        with self.lock:
            held = self.held.get(island_id, RangeSet())
            for a, b in ranges:
                if held.overlap(a, b) != b - a:
                    raise Refused(Reason.NOT_LEASED, f"samples [{a}, {b}) are not leased to {island_id} (the coordinator "
                                  "may have restarted from an older checkpoint); resync and take new leases")
                if self.folded[fragment].overlap(a, b):
                    raise Refused(Reason.NOT_LEASED, f"samples [{a}, {b}) are folded already; resync and go on")
            named = self.named.setdefault(island_id, RangeSet())
            for a, b in ranges:
                named.add(a, b)

    def fold(self, fragment: int, ranges: list[Range]) -> int:
        """Records positions as folded into `fragment`; returns how many."""
        with self.lock:
            n = 0
            for a, b in ranges:
                self.repeated[fragment] += self.folded[fragment].add(a, b)
                n += b - a
            return n

    def give_back(self, island_id: str, ranges: list[Range]) -> int:
        """Positions an island leaves without training: leased again. Returns how many were taken back."""
        with self.lock:
            held = self.held.get(island_id, RangeSet())
            n = 0
            for a, b in ranges:
                if a < b and held.overlap(a, b) == b - a and not any(f.overlap(a, b) for f in self.folded):
                    held.remove(a, b)
                    self.free.add(a, b)
                    n += b - a
            self.returned += n
            return n

    def settle(self, fragment: int, pushed: list[list[Range]], live: list[str]) -> pb.DataAccount:
        """A round closed with these contributions' positions: folds them, returns the account after."""
        n = sum(self.fold(fragment, ranges) for ranges in pushed)
        if fragment == 0:  # every fragment closes once a round: the run's rounds are the first fragment's
            self.refill()
        account = self.account(fragment, live, folded_this_round=n)
        account.samples.extend(pb.SampleRange(start=a, stop=b) for a, b in RangeSet([r for rs in pushed for r in rs]))
        return account

    # --- the account -------------------------------------------------------------------------

    def account(self, fragment: int, live: list[str], folded_this_round: int = 0) -> pb.DataAccount:
        """The data stream in tokens: leased, folded, returned, held by live islands, lost, repeated."""
        t = self.tokens_per_sample
        with self.lock:
            folded = self.folded[fragment]
            held = 0
            for island_id in live:
                mine = self.held.get(island_id)
                if mine is not None:
                    held += sum(b - a - folded.overlap(a, b) for a, b in mine)
            lost = self.leased - self.returned - folded.size - held
            newest = max(self.cursor - 1, 0)
            return pb.DataAccount(
                leased=self.leased * t, folded=folded.size * t, returned=self.returned * t, lost=lost * t, held=held * t,
                repeated=self.repeated[fragment] * t, folded_this_round=folded_this_round * t, epoch=newest // self.epoch_size,
            )

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        with self.lock:
            return {
                "epoch_size": self.epoch_size, "cursor": self.cursor, "free": self.free.to_list(),
                "leases": {i: {str(k): [list(r) for r in v] for k, v in m.items()} for i, m in self.leases.items()},
                "asked": dict(self.asked), "sizes": dict(self.sizes),
                "held": {i: s.to_list() for i, s in self.held.items()},
                "named": {i: s.to_list() for i, s in self.named.items()},
                "folded": [f.to_list() for f in self.folded], "leased": self.leased, "returned": self.returned,
                "repeated": list(self.repeated),
            }

    def load_state_dict(self, state: dict) -> None:
        if state["epoch_size"] != self.epoch_size:
            raise ValueError(f"the checkpoint's data has {state['epoch_size']} samples an epoch, this run's {self.epoch_size}: "
                             "resume on the corpus the run started with")
        with self.lock:
            self.cursor, self.free = state["cursor"], RangeSet([tuple(r) for r in state["free"]])
            self.leases = {i: {int(k): [tuple(r) for r in v] for k, v in m.items()} for i, m in state["leases"].items()}
            self.held = {i: RangeSet([tuple(r) for r in s]) for i, s in state["held"].items()}
            self.named = {i: RangeSet([tuple(r) for r in s]) for i, s in state.get("named", {}).items()}
            self.asked, self.sizes = dict(state["asked"]), dict(state["sizes"])
            self.folded = [RangeSet([tuple(r) for r in f]) for f in state["folded"]]
            self.leased, self.returned, self.repeated = state["leased"], state["returned"], list(state["repeated"])


def _minus(a: int, b: int, holes: list[Range]) -> list[Range]:
    """[a, b) without the sorted, disjoint holes inside it."""
    out, at = [], a
    for s, e in holes:
        if s > at:
            out.append((at, s))
        at = max(at, e)
    return out + ([(at, b)] if at < b else [])
