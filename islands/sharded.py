"""An island's connection to a coordinator of several shards (docs/sharding.md), with CoordinatorClient's calls.

The leading shard answers the join with every shard's address and a ticket;
the island joins the others on it. From then on every call that carries
parameters (fetch, push, pull) is split by the shard map, the same one the
shards compute (diloco/shardmap.py), and sent to every shard concerned at
once, each on its own connection; what comes back is put together so that the
island sees one coordinator: a fragment's checksum is its shards' checksums
joined in shard order, and its round the one they all agree on. A refusal from
one shard is the call's refusal (the most severe one, after every shard
answered), so the island's usual recovery (a resync, a rejoin) follows, and
retries only repeat calls that carry nothing twice.

The membership calls go where they belong: joins and heartbeats and leaves to
every shard (each keeps its own leases), leases of the token corpus to the
leader, which alone keeps the ledger.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from diloco.fragments import Fragment, FragmentLayout
from diloco.shardmap import ShardMap, join_checksums, split_checksum
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import FlatRange, Manifest
from diloco.wire.refusal import Reason
from islands.client import CoordinatorClient, LocalRefusal
from islands.outcome import Next, next_step

_AGREE_S = 60.0  # the longest the shards may stand at different rounds before a fetch gives up


class ShardedClient:
    """CoordinatorClient's interface over the leading shard's client and, once joined, the others'."""

    def __init__(self, leader: CoordinatorClient, connect: Callable[[str], CoordinatorClient]):
        self.clients = [leader]
        self.connect = connect  # a client for a following shard's address (the leader's options and credentials)
        self.map: ShardMap | None = None
        # A pull cut short by one shard's wait (STILL_OPEN) keeps what the others delivered: asked again, a shard that
        # sent a delta would add it twice. (fragment, round) -> shard -> header.
        self._pulled: dict[tuple[int, int], dict[int, pb.ResultHeader]] = {}
        # The shards a pull found without our contribution (PUSH_AGAIN: one restarted): the push that follows goes to
        # them alone. Sent to every shard, the others refused it (ROUND_CLOSED: closing with it already) and the island
        # resynced a round it was in, pushing empty contributions in a loop (the issue-42 team run). (fragment, round).
        self._push_again: dict[tuple[int, int], set[int]] = {}

    @property
    def leader(self) -> CoordinatorClient:
        return self.clients[0]

    # --- what the island reads and sets on its client ---------------------------------------------------

    @property
    def codecs(self) -> dict:
        return self.leader.codecs

    @property
    def address(self) -> str:
        return self.leader.address

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.clients)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.clients)

    @property
    def on_call(self):
        return self.leader.on_call

    @on_call.setter
    def on_call(self, observer) -> None:
        for c in self.clients:
            c.on_call = observer

    @property
    def replaced(self):
        """A shard's REPLACED refusal of a heartbeat (another process joined as this island), or None."""
        return next((c.replaced for c in self.clients if c.replaced is not None), None)

    @property
    def progress(self) -> bool:
        return self.leader.progress

    @progress.setter
    def progress(self, on: bool) -> None:
        self.leader.progress = on

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def stop_heartbeat(self) -> None:
        for c in self.clients:
            c.stop_heartbeat()

    def start_heartbeat(self, *args, **kwargs) -> None:
        for c in self.clients:
            c.start_heartbeat(*args, **kwargs)

    # --- joining ------------------------------------------------------------------------------------------

    def join(self, config_digest: str = "", codec: str = "", island_id: str = "", island_key: str = "",
             ranks: int = 1) -> pb.JoinResponse:
        """Joins the leader, then every other shard on the leader's ticket; returns the leader's reply."""
        reply = self.leader.join(config_digest, codec, island_id, island_key, ranks)
        self.adopt(reply)
        for shard, client in enumerate(self.clients[1:], start=1):
            theirs = client.join(config_digest, codec, reply.island_id, island_key, ranks, shard_ticket=reply.shard_ticket)
            # The same model and layout give every shard the map the island computes (diloco/shardmap.py).
            if (theirs.parameters, theirs.fragments, theirs.config_digest) != (reply.parameters, reply.fragments, reply.config_digest):
                raise LocalRefusal(Reason.CONFIG_MISMATCH, f"coordinator shard {shard} serves another model, layout or config "
                                   "than the leading shard; start every shard with the same config and release")
        return reply

    def adopt(self, reply: pb.JoinResponse) -> None:
        """Learns the shard map from the leader's join reply and connects to the other shards (every rank)."""
        if len(reply.shard_addresses) <= 1 or self.map is not None:
            return
        manifest = Manifest.from_proto(reply.parameters)
        layout = FragmentLayout(tuple(Fragment(f.index, tuple(f.names), f.offset) for f in reply.fragments), 1)
        self.map = ShardMap.of(layout, {n: manifest.numel(n) for n in manifest.shapes}, len(reply.shard_addresses))
        leader = self.leader
        for address in reply.shard_addresses[1:]:
            client = self.connect(address)
            client.codecs = leader.codecs  # one dict: the island adds the downlink's codec to it
            client.on_call, client.progress = leader.on_call, False
            self.clients.append(client)

    # --- calls that carry parameters ------------------------------------------------------------------

    def _parts(self, manifest: Manifest, targets: Mapping[str, torch.Tensor] | None,
               ranges: list[FlatRange] | None) -> list[tuple[int, Manifest, dict, list[FlatRange] | None]]:
        """(shard, its manifest, its targets, its ranges) for every shard the call concerns."""
        parts = []
        for shard, names in enumerate(self.map.split(list(manifest.shapes))):
            mine = set(names)
            own_ranges = [r for r in ranges if r.name in mine] if ranges is not None else None
            if not names or (own_ranges is not None and not own_ranges):
                continue
            own_targets = {n: targets[n] for n in names if n in targets} if targets is not None else {}
            parts.append((shard, Manifest({n: manifest.shapes[n] for n in names}), own_targets, own_ranges))
        return parts

    def fetch(self, island_id: str, targets: Mapping[str, torch.Tensor], manifest: Manifest,
              ranges: list[FlatRange] | None = None, fragment: int | None = None) -> pb.ResultHeader:
        if self.map is None:
            return self.leader.fetch(island_id, targets, manifest, ranges, fragment)
        # Shards close a round each on its own: fetched in between, they would be a round apart. Fetch again until
        # every fragment's round agrees (a round closes on every shard within moments of the first).
        deadline = time.monotonic() + _AGREE_S
        while True:
            headers = _all(self.clients, [
                (shard, lambda c, m=m, t=t, r=r: c.fetch(island_id, t, m, r, fragment))
                for shard, m, t, r in self._parts(manifest, targets, ranges)])
            combined = _combine(headers, self.map.shards)
            if combined is not None:
                return combined
            if time.monotonic() > deadline:
                rounds = {s: h.round for s, h in headers}
                raise LocalRefusal(Reason.REASON_UNSPECIFIED, f"the coordinator's shards stayed at different rounds for "
                                   f"{_AGREE_S:.0f} s ({rounds}): one resumed from an older checkpoint; restart every "
                                   "shard with --resume (they resume from the newest round all of them committed)")
            time.sleep(0.2)

    def pull(self, island_id: str, round_: int, targets: Mapping[str, torch.Tensor], manifest: Manifest, held: str,
             timeout_s: float, ranges: list[FlatRange] | None = None, fragment: int = 0, mean=None) -> pb.ResultHeader:
        if self.map is None:
            return self.leader.pull(island_id, round_, targets, manifest, held, timeout_s, ranges, fragment, mean)
        if mean is not None:
            raise LocalRefusal(Reason.BAD_REQUEST, "eager updates (streaming.eager) are not served by a sharded coordinator yet")
        helds = split_checksum(held, self.map.shards)
        done = self._pulled.setdefault((fragment, round_), {})
        results, errors = _gather(self.clients, [
            (shard, lambda c, m=m, t=t, r=r, h=helds[shard]: c.pull(island_id, round_, t, m, h, timeout_s, r, fragment))
            for shard, m, t, r in self._parts(manifest, targets, ranges) if shard not in done])
        done.update(results)
        if errors:
            worst = _worst(list(errors.values()))
            again = {shard for shard, e in errors.items() if isinstance(e, grpc.RpcError) and next_step(e) is Next.PUSH_AGAIN}
            if again:
                self._push_again[(fragment, round_)] = again
            if not isinstance(worst, grpc.RpcError) or next_step(worst) is not Next.WAIT:
                del self._pulled[(fragment, round_)]  # the island starts the round over: nothing of it counts
            raise worst
        del self._pulled[(fragment, round_)]
        combined = _combine(sorted(done.items()), self.map.shards)
        if combined is None:
            raise LocalRefusal(Reason.CHECKSUM_MISMATCH, "the coordinator's shards answered the pull at different rounds; fetch")
        return combined

    def push(self, header: pb.PushHeader, chunks) -> pb.PushResponse:
        """chunks: the islands' RegeneratingChunks (islands/round.py push), which make each shard's chunks alone."""
        if self.map is None:
            return self.leader.push(header, chunks)
        sums = split_checksum(header.global_checksum, self.map.shards)
        only = self._push_again.pop((header.fragment, header.round), None)  # a push again: to those that lost it
        calls = []
        for shard, names in enumerate(self.map.split(list(self.map.owner))):
            if chunks.names is not None and not set(names) & set(chunks.names):
                continue  # this rank holds nothing of that shard's parameters
            if only is not None and shard not in only:
                continue
            own = pb.PushHeader()
            own.CopyFrom(header)
            own.global_checksum = sums[shard]
            if shard:
                del own.samples[:]  # the leader keeps the ledger
            calls.append((shard, lambda c, h=own, n=frozenset(names): c.push(h, chunks.only(n))))
        responses = [r for _, r in _all(self.clients, calls)]
        elements = sum(r.elements for r in responses)
        late = [r for r in responses if r.late]
        return pb.PushResponse(accepted=all(r.accepted for r in responses), elements=elements,
                               contribution_complete=all(r.contribution_complete for r in responses), late=bool(late),
                               folded_into=max((r.folded_into for r in late), default=0))

    # --- membership -------------------------------------------------------------------------------------

    def lease(self, island_id: str, index: int, samples: int) -> pb.LeaseResponse:
        return self.leader.lease(island_id, index, samples)

    def leave(self, island_id: str, params_checksum: str, round_: int, stats: Mapping[str, float] | None = None,
              fragment_checksums: list[str] | None = None, untrained: list[tuple[int, int]] = ()) -> pb.LeaveResponse:
        if self.map is None:
            return self.leader.leave(island_id, params_checksum, round_, stats, fragment_checksums, untrained)
        k = self.map.shards
        per_fragment = [_parts_of(c, k) for c in fragment_checksums or []]
        whole = _parts_of(params_checksum, k)
        replies = _all(self.clients, [
            (s, lambda c, s=s: c.leave(island_id, whole[s], round_, stats, [p[s] for p in per_fragment],
                                       untrained if s == 0 else ()))
            for s in range(k)], raise_first=False)
        ordered = [r for _, r in sorted(replies, key=lambda p: p[0])]
        return pb.LeaveResponse(checksum_matches=all(r.checksum_matches for r in ordered),
                                checksum=join_checksums([r.checksum for r in ordered]))


def _parts_of(checksum: str, shards: int) -> list[str]:
    """A joined checksum's parts, or the same text for every shard when it is not one (a note such as "differs")."""
    try:
        return split_checksum(checksum, shards)
    except ValueError:
        return [checksum] * shards


def _gather(clients: Sequence[CoordinatorClient], calls: list[tuple[int, Callable[[CoordinatorClient], Any]]]
            ) -> tuple[dict[int, Any], dict[int, BaseException]]:
    """Runs each call on its shard's client at once; returns what each shard answered and what each raised."""
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def run(shard: int, call) -> None:
        try:
            results[shard] = call(clients[shard])
        except BaseException as e:  # noqa: BLE001 - handed to the caller, after every shard answered
            errors[shard] = e

    threads = [threading.Thread(target=run, args=(s, call), name=f"shard-{s}", daemon=True) for s, call in calls[1:]]
    for t in threads:
        t.start()
    if calls:
        run(*calls[0])
    for t in threads:
        t.join()
    return results, errors


def _worst(errors: list[BaseException]) -> BaseException:
    """The refusal that calls for the most (islands/outcome.py Next), or the first error that is none."""
    refusals = [e for e in errors if isinstance(e, grpc.RpcError)]
    return max(refusals, key=lambda e: next_step(e).value) if len(refusals) == len(errors) else errors[0]


def _all(clients: Sequence[CoordinatorClient], calls: list[tuple[int, Callable[[CoordinatorClient], Any]]],
         raise_first: bool = True) -> list[tuple[int, Any]]:
    """Runs each call on its shard's client at once; after all of them ended, raises the most severe refusal."""
    results, errors = _gather(clients, calls)
    if errors and raise_first:
        raise _worst(list(errors.values()))
    return sorted(results.items(), key=lambda p: p[0])


def _combine(headers: list[tuple[int, pb.ResultHeader]], shards: int) -> pb.ResultHeader | None:
    """One header from the shards' (in shard order); None when they are not at the same rounds. A shard the call
    did not concern (a rank holding none of its parameters) has "" for its part of each checksum."""
    first = headers[0][1]
    if any(h.round != first.round or [f.round for f in h.fragments] != [f.round for f in first.fragments]
           for _, h in headers):
        return None

    def joined(of: Callable[[pb.ResultHeader], str]) -> str:
        parts = [""] * shards
        for shard, h in headers:
            parts[shard] = of(h)
        return join_checksums(parts)

    out = pb.ResultHeader()
    out.CopyFrom(first)
    out.checksum = joined(lambda h: h.checksum)
    out.ranges_checksum = joined(lambda h: h.ranges_checksum)
    out.run_finished = all(h.run_finished for _, h in headers)
    out.held_s = max(h.held_s for _, h in headers)
    for i, f in enumerate(out.fragments):
        f.checksum = joined(lambda h, i=i: h.fragments[i].checksum)
    return out
