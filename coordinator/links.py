"""Compression per link: each island's delivered throughput, and the codec it is advised to push with.

Links differ (100 Mbit/s to tens of Gbit/s): one codec is too lossy for the
fast ones or too slow for the slow ones. With `wire.link_codecs` the
coordinator measures every push stream it receives (bytes over the seconds from
its header to its last chunk: what the island's link and encoder deliver,
smoothed over rounds) and, when an island pulls a round's result, advises the
codec for its next push of that fragment: the first of the list (least lossy
first) whose push, at that throughput, fits `wire.link_fraction` of the round's
time, else the last. The round's time is `rounds.round_s` with time-boxed
rounds, else the fragment's last round from open to close; before any round
closed, or before the island's first push, nothing is advised (it keeps its codec).

Only the uplink changes: every island still applies the same published update,
so copies stay bit-identical, and the island's error feedback is codec-agnostic
(the residual owed is what was not sent, whatever sent it). An advice is decided
once per (island, fragment, round) and kept, so every rank and replica group of
an island, and a pull that is retried, hear the same one.
"""

from __future__ import annotations

import threading

from diloco.wire.codec import Codec

_SMOOTHING = 0.5  # weight of the newest measurement in the running throughput
_KEEP_ROUNDS = 4  # advice kept per island and fragment (rounds an island may still pull)


class LinkAdvisor:
    def __init__(self, codecs: list[Codec], fraction: float):
        self.codecs, self.fraction = codecs, fraction
        self.bytes_per_s: dict[str, float] = {}
        self.advised: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    def observe(self, island_id: str, nbytes: int, seconds: float) -> None:
        """A push stream of nbytes was received over seconds."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self.bytes_per_s.get(island_id)
            self.bytes_per_s[island_id] = rate if old is None else (1 - _SMOOTHING) * old + _SMOOTHING * rate

    def choose(self, bytes_per_s: float, numel: int, round_s: float) -> str:
        """The least lossy codec whose push of numel elements takes at most fraction x round_s; else the most lossy."""
        budget = self.fraction * round_s
        for codec in self.codecs:
            if codec.encoded_size(numel) / bytes_per_s <= budget:
                return codec.name
        return self.codecs[-1].name

    def advise(self, island_id: str, fragment: int, round_: int, numel: int, round_s: float) -> str:
        """The codec island_id pushes round_ of fragment with ("" when there is nothing to go on yet)."""
        key = (island_id, fragment, round_)
        with self._lock:
            if key in self.advised:
                return self.advised[key]
            rate = self.bytes_per_s.get(island_id)
            if rate is None or round_s <= 0:
                return ""
            name = self.advised[key] = self.choose(rate, numel, round_s)
            for old in [k for k in self.advised if k[:2] == key[:2] and k[2] < round_ - _KEEP_ROUNDS]:
                del self.advised[old]
            return name
