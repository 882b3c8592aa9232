"""Whether a round should wait for a push still arriving: its own pace against the others' (issue 42 item 7).

limits.push_floor_mbps cuts off a push slower than the floor, but a member
pushing just above it still holds a large model's round for hours: 0.5 GB at
1 Mbit/s is more than an hour. So once every other island the round waits for is
in, a push still arriving is measured against them: the elements it has sent in
the time since its first chunk give its pace, and from that the time its
contribution would take in all. The round waits for it only while that stays
within limits.push_pace_factor times the median time the others' pushes took,
plus limits.push_idle_s (the stall any push may have). An honest island on a
link a few times slower is waited for; one slower still is folded late
(rounds.late_rounds) or not at all, as at the deadline, and per-link compression
(wire.link_codecs) is what brings such a link back to the others' pace.

A member that has not begun pushing is not judged here: the round waits for it
as before (to the deadline; limits.idle_rounds removes one that never pushes).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass
class Arrival:
    """One island's pushes into one round so far: when the first chunk came, the elements since, when it was whole."""

    began: float
    elements: int = 0
    whole_at: float | None = None


class PushPace:
    """The arrivals of one fragment's recent rounds, by (island, round); the caller holds the round's lock."""

    def __init__(self, factor: float, slack_s: float):
        self.factor, self.slack_s = factor, slack_s  # factor 0: every push is waited for (only the deadline ends it)
        self.arrivals: dict[tuple[str, int], Arrival] = {}

    def arrived(self, island_id: str, round_: int, elements: int, now: float) -> None:
        arrival = self.arrivals.setdefault((island_id, round_), Arrival(now))
        arrival.elements += elements

    def whole(self, island_id: str, round_: int, now: float) -> None:
        arrival = self.arrivals.get((island_id, round_))
        if arrival is not None and arrival.whole_at is None:
            arrival.whole_at = now

    def forget_before(self, round_: int) -> None:
        self.arrivals = {k: a for k, a in self.arrivals.items() if k[1] >= round_}

    def too_slow(self, round_: int, pending: list[str], done: list[str], numel: int, now: float) -> dict[str, float]:
        """Of the islands still pushing round_, those whose pace says their contribution of numel elements takes longer
        than the bound set by the done ones' pushes: island -> the seconds it would still take (inf: nothing came)."""
        took = [a.whole_at - a.began for i in done
                if (a := self.arrivals.get((i, round_))) is not None and a.whole_at is not None]
        if not self.factor or not took:
            return {}
        bound = self.factor * statistics.median(took) + self.slack_s
        slow = {}
        for island in pending:
            arrival = self.arrivals.get((island, round_))
            if arrival is None or arrival.whole_at is not None:
                continue
            spent = now - arrival.began
            left = (numel - arrival.elements) * spent / arrival.elements if arrival.elements else math.inf
            if spent + left > bound and spent > 0:
                slow[island] = left
        return slow
