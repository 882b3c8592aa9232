"""gRPC adapter: turns diloco.v1.Coordinator calls into CoordinatorState calls."""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from coordinator.audit import NoAudit
from coordinator.gather import leader_reads_refusal
from coordinator.judging import MAX_PIECES, LeaderJudge, close_refusal, verdict_proto
from coordinator.ledger import lease_bound, ranges_of
from coordinator.limits import Abandoned, Limits, idle_bounded
from coordinator.publish import Reading
from coordinator.rollback import RollBack
from coordinator.sharding import ShardRole
from coordinator.state import CoordinatorState
from coordinator.streams import OpenStreams, Ticket
from diloco.security.credentials import (
    CredentialError,
    identity_from_auth_context,
    ranks_from_auth_context,
    unranked_refusal,
)
from diloco.security.untrusted import CHECKSUM_MAX, ID_MAX, bounded
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.frames import ChunkView, chunk_deserializer, frame_chunk, serialized
from diloco.wire.messages import (
    PROTOCOL_VERSION,
    PUSH_ADMITTED,
    instance_from,
    ChunkError,
    FlatRange,
    overlapping_chunks,
    ranges_from_proto,
)
from diloco.wire.refusal import Reason, Refused

log = logging.getLogger(__name__)


def _abort(context: grpc.ServicerContext, e: Refused):
    """The refusal's status and message, with its typed reason in the trailing metadata."""
    context.set_trailing_metadata(e.trailing)
    context.abort(e.code, str(e))


def _refusals(method):
    """Maps Refused to its gRPC status, message and typed reason (streams too), and audits it."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            result = method(self, request, context)
        except Refused as e:
            self.audit_refusal(method.__name__, request, context, e)
            _abort(context, e)
        if hasattr(result, "__next__"):
            return _guard(result, context, lambda e: self.audit_refusal(method.__name__, request, context, e))
        return result

    return wrapper


def _guard(stream: Iterator, context: grpc.ServicerContext, audit) -> Iterator:
    try:
        yield from stream
    except Refused as e:
        audit(e)
        _abort(context, e)


def _refuse_overlaps(ranges: list[FlatRange], total: int) -> None:
    """Refuses requested ranges that ask for an element twice (two ranges of a parameter that overlap, or start at
    the same offset) or for more elements than there are: a 141 KiB request once asked for 168 MiB of one model."""
    asked = sum(r.numel for r in ranges)
    if asked > total:
        raise Refused(Reason.BAD_REQUEST, f"the requested ranges ask for {asked} elements, more than the {total} there are")
    ordered = sorted(ranges, key=lambda r: (r.name, r.offset, r.numel))
    for a, b in zip(ordered, ordered[1:]):
        if a.name == b.name and (b.offset < a.end or b.offset == a.offset):
            raise Refused(Reason.BAD_REQUEST, f"{b.name}: requested elements [{a.offset}, {a.end}) and [{b.offset}, {b.end}) "
                          "overlap; ask for each element once")


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, state: CoordinatorState, stop: threading.Event, mutual_tls: bool = False, audit=None,
                 shard: ShardRole | None = None, judges: LeaderJudge | None = None, rollback: RollBack | None = None):
        self.state = state
        self.rollback = rollback  # a shard of several: the leader's word that every shard resumes from their checkpoint
        self.shard = shard  # this process's place among the coordinator's shards (None: the only one)
        self.judges = judges  # the leading shard of several: the rounds' verdicts (coordinator/judging.py)
        self.stop = stop
        self.mutual_tls = mutual_tls  # callers present a client certificate of the run's CA: their name is who they are
        self.audit = audit or NoAudit()
        self.limits = Limits(state.cfg.limits, state.cfg.rounds.heartbeat_s)
        self.streams = OpenStreams(state.cfg.limits, state.members.revoked, self._wake, stop)  # watches, fetches, pulls

    def _wake(self) -> None:
        with self.state.cond:
            self.state.cond.notify_all()

    def _ranks(self, island_id: str) -> int:
        island = self.state.islands.get(island_id)
        return island.ranks if island is not None else 1

    def _who(self, context) -> dict:
        name = identity_from_auth_context(context.auth_context()) if self.mutual_tls else None
        return {"peer": context.peer(), **({"credential": name} if name else {})}

    def audit_refusal(self, method: str, request, context, e: Refused) -> None:
        with self.state.cond:
            counts = self.state.events.refusals
            counts[pb.Refusal.Reason.Name(e.reason)] = counts.get(pb.Refusal.Reason.Name(e.reason), 0) + 1
        island = bounded(getattr(request, "island_id", ""), ID_MAX) if not hasattr(request, "__next__") else ""
        self.audit.record("refused", method=method, island=island, reason=pb.Refusal.Reason.Name(e.reason), message=str(e),
                          **self._who(context))

    def _caller(self, context, island_id: str, joining: bool = False) -> str | None:
        """The caller's name (its client certificate's), refused unless island_id is its own; None without TLS. A
        call from a process that another one replaced as island_id is refused REPLACED (a join may replace it)."""
        owner = None
        if self.mutual_tls:
            owner = identity_from_auth_context(context.auth_context())
            if owner is None:
                raise Refused(Reason.NOT_YOURS, "the client certificate names no island; issue one with `diloco-certs island`")
            self.state.members.check_owner(island_id, owner)
        if not joining:
            self.state.members.check_instance(island_id, instance_from(context.invocation_metadata()))
        return owner

    def _most_ranks(self, context) -> tuple[int, str]:
        """The most ranks the caller may declare, and what sets it: its certificate's ranks (mutual TLS), else
        rounds.max_island_ranks (plaintext, or a certificate issued without ranks where
        rounds.allow_unranked_certificates lets one join: refused otherwise). Never the island's word."""
        cap = self.state.cfg.rounds.max_island_ranks
        if not self.mutual_tls:
            return cap, f"rounds.max_island_ranks = {cap} (plaintext: no certificate)"
        try:
            granted = ranks_from_auth_context(context.auth_context())
        except CredentialError as e:
            raise Refused(Reason.BAD_REQUEST, str(e)) from None
        if granted is None:
            if not self.state.cfg.rounds.allow_unranked_certificates:
                raise Refused(Reason.BAD_REQUEST, unranked_refusal(identity_from_auth_context(context.auth_context())))
            return cap, f"rounds.max_island_ranks = {cap} (its certificate carries no ranks)"
        return granted, "its certificate"

    def _check_ranks(self, context, declared: int, owner: str | None) -> None:
        """Refuses a Join declaring more ranks than the caller may (a rejoin included: it cannot raise them)."""
        most, source = self._most_ranks(context)
        if 0 <= declared <= most:
            return
        if owner is not None:
            fix = (f"issue the island a certificate for its ranks (`diloco-certs island DIR {owner} --ranks {max(declared, 1)} "
                   "--force`) or join with fewer")
        else:
            fix = "raise rounds.max_island_ranks on the coordinator, or join with fewer"
        raise Refused(Reason.BAD_REQUEST, f"the island declared {declared} ranks; {source} allows 1 to {most}: {fix}")

    @_refusals
    def Join(self, request: pb.JoinRequest, context) -> pb.JoinResponse:
        state, cfg = self.state, self.state.cfg
        if request.protocol_version != PROTOCOL_VERSION:
            raise Refused(
                Reason.PROTOCOL_MISMATCH,
                f"protocol version {request.protocol_version} is not {PROTOCOL_VERSION}; run the same diloco release everywhere",
            )
        if request.codec and request.codec != state.codec.name:
            raise Refused(
                Reason.CODEC_MISMATCH,
                f"codec mismatch: the island is configured for {request.codec!r} but the run uses {state.codec.name!r}; "
                "use the coordinator's config (or omit --config to adopt it)",
            )
        if request.config_digest and request.config_digest != cfg.digest():
            raise Refused(
                Reason.CONFIG_MISMATCH,
                f"config mismatch: the island's config digest is {request.config_digest}, the coordinator's is "
                f"{cfg.digest()}; start the island with the coordinator's config file, or without --config to adopt it",
                config_toml=cfg.to_toml(),  # the island names the keys that differ (islands/joining.py)
            )
        owner = self._caller(context, request.island_id, joining=True)
        if owner is not None:
            self.limits.join(owner)
        self._check_ranks(context, request.ranks, owner)
        following = self.shard is not None and not self.shard.leads
        if following and not self.shard.admits(request.shard_ticket, request.island_id, owner, request.ranks):
            raise Refused(Reason.NOT_YOURS, f"this is shard {self.shard.index} of {self.shard.count}: it admits islands "
                          f"with the ticket the leading shard ({self.shard.addresses[0]}) gives them at join; join there")
        replaced: list[str] = []  # the live process of the island this join replaces, if any
        island = state.join(request.hostname or context.peer(), request.island_id, request.island_key, owner, request.ranks,
                            assigned=following, instance=instance_from(context.invocation_metadata()), peer=context.peer(),
                            replaced=replaced)
        self.audit.record("join", island=island.island_id, ranks=island.ranks, hostname=island.hostname, **self._who(context))
        return pb.JoinResponse(
            island_id=island.island_id,
            config_digest=cfg.digest(),
            config_toml=cfg.to_toml(),
            round=state.round,
            parameters=state.model[0].to_proto(),
            codec=state.codec.name,
            downlink_codec=state.publication.codec.name,
            max_chunk_bytes=cfg.wire.chunk_bytes,
            heartbeat_interval_s=cfg.rounds.heartbeat_s,
            shard_index=island.shard,
            total_rounds=cfg.rounds.rounds,
            fragments=[pb.FragmentSpec(index=f.index, names=list(f.names), offset=f.offset) for f in state.model[1]],
            fragment_rounds=[f.round for f in state.fragments],
            data_digest=state.data_digest,
            data_epoch_size=state.ledger.epoch_size if state.ledger is not None else 0,
            replaced=replaced[0] if replaced else "",
            **self._shard_map_for(island, owner),
        )

    def _shard_map_for(self, island, owner: str | None) -> dict:
        """The leading shard tells a joining island every shard's address and the ticket the others admit it on."""
        if self.shard is None or not self.shard.leads:
            return {}
        return {"shard_addresses": list(self.shard.addresses),
                "shard_ticket": self.shard.ticket(island.island_id, owner, island.ranks)}

    @_refusals
    def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        self._caller(context, request.island_id)
        if not self.state.members.is_member(request.island_id):  # before its rate bucket: only members get one
            raise Refused(Reason.NOT_A_MEMBER, f"unknown island {bounded(request.island_id, ID_MAX)!r} (lease expired?); "
                          "join again")
        self.limits.heartbeat(request.island_id, self._ranks(request.island_id))
        report = {k: getattr(request, k) for k in ("utilization", "tokens_per_s", "train_loss")}
        self.state.members.touch(request.island_id, {k: v for k, v in report.items() if math.isfinite(v)})
        return pb.HeartbeatResponse(round=self.state.round, run_finished=self.state.phase.value == "finished")

    def _ranges(self, requested, fragment: int | None = None) -> list[FlatRange] | None:
        """The flat ranges a request names (None: the whole model, or the whole fragment). Refused: ranges outside
        a tensor, ranges that overlap, and more elements than there are (a small request asking for many copies)."""
        if not requested:
            return None
        manifest = self.state.manifest if fragment is None else self.state.fragment(fragment).manifest
        try:
            ranges = ranges_from_proto(requested, manifest)
        except ChunkError as e:
            raise Refused(Reason.BAD_REQUEST, str(e)) from e
        _refuse_overlaps(ranges, manifest.total_numel())
        return ranges

    @contextmanager
    def _reading(self, fragment: int | None, delta_from_round: int | None, want_mean: bool, ranges: list[FlatRange] | None,
                 cancel) -> Iterator[Reading]:
        """What a result of the whole model, or of one fragment, sends (publish.py Reading): taken under the
        parameters' read lock, which is released before anything is sent (FragmentRounds.reading)."""
        if fragment is None:
            with self.state.reading(ranges, cancel) as reading:
                yield reading
        else:
            with self.state.fragment(fragment).reading(delta_from_round, want_mean, ranges, cancel) as reading:
                yield reading

    def _result(
        self, island_id: str, delta_from_round: int | None, ranges: list[FlatRange] | None = None,
        fragment: int | None = None, want_mean: bool = False, held_s: float = 0.0, context=None, ticket: Ticket | None = None,
        counted: bool = True,
    ) -> Iterator[pb.ResultMessage | bytes]:
        """The global parameters: as fp32 values, or as the last round's delta when the island can take it.

        With ranges (one rank of a sharded island), only the chunks for those
        ranges, and the header carries their checksum so the rank can verify
        what it holds. With a fragment, only that fragment's parameters (and,
        for eager updates, the round's mean pseudo-gradient after them). Sent at
        the client's pace holding no lock; a revoked caller is refused at its
        next message (ticket), and context's call is cancelled should the values
        it reads be dropped (publish.py Publication._supersede).
        """
        cancel = context.cancel if context is not None else (lambda: None)
        with self._reading(fragment, delta_from_round, want_mean, ranges, cancel) as reading:
            header = reading.header
            header.held_s = held_s
            if fragment is not None and island_id != "observer":  # compression per link: its next push's codec
                header.push_codec = self.state.advise_codec(island_id, fragment, header.round)
            sent = 0
            for message in self._messages(reading, ranges, fragment):
                if ticket is not None:
                    ticket.check()
                sent += len(message) if isinstance(message, bytes) else message.ByteSize()
                yield message
        if counted:
            self.state.count_down(header.round, island_id, sent, fragment or 0)

    def _messages(self, reading: Reading, ranges: list[FlatRange] | None, fragment: int | None) -> Iterator[pb.ResultMessage | bytes]:
        """A result's messages: its header, the update's or the values' chunks, the mean's, and a streamed update's
        trailer. Chunks are framed by hand (diloco/wire/frames.py): a ResultMessage around each would copy it through upb."""
        yield pb.ResultMessage(header=reading.header)
        if reading.delta is not None:
            chunks = reading.delta if ranges is None else overlapping_chunks(reading.delta, ranges)
            yield from (frame_chunk(2, c) for c in chunks)
        else:  # the values, serialized once a round whoever reads them (publish.py PublishedValues)
            yield from reading.value_messages(ranges)
        for chunk in reading.mean if ranges is None else overlapping_chunks(reading.mean, ranges):
            yield frame_chunk(3, chunk)  # ResultMessage field 3: mean_chunk
        if reading.stream is not None:  # the header went out before the update was whole: what it could not say
            trailer = reading.stream.trailer()
            if ranges is not None:
                trailer.ranges_checksum = self.state.fragment(fragment).ranges_checksum_after(reading.stream, ranges)
            yield pb.ResultMessage(trailer=trailer)

    def _leader_reads(self, request: pb.FetchRequest | pb.WatchRequest) -> bool:
        """The leading shard reading this following one's values or rounds (coordinator/gather.py)."""
        return (self.shard is not None and not self.shard.leads and not getattr(request, "island_id", "")
                and leader_reads_refusal(self.shard.secret, self.shard.index, request) is None)

    def _credential(self, context) -> str | None:
        """The caller's credential (mutual TLS), None without TLS; refused when revoked or naming no island."""
        return self._caller(context, "")

    @_refusals
    def FetchParameters(self, request: pb.FetchRequest, context) -> Iterator[pb.ResultMessage]:
        # The leading shard reading this one's part for its evaluation (coordinator/gather.py); else an island or a
        # watcher, who is who its certificate says.
        leader = self._leader_reads(request)
        credential = None if leader else self._caller(context, request.island_id)
        if request.island_id:
            self.state.touch(request.island_id)
        fragment = request.fragment if request.HasField("fragment") else None
        if fragment is not None:
            self.state.fragment(fragment)  # refuses a fragment that does not exist
        ranges = self._ranges(request.ranges, fragment)
        # An observer (no island id) counts under its credential, or without TLS its host.
        holder = request.island_id or (credential or context.peer().rsplit(":", 1)[0])
        with self.limits.stream("result", holder, self._ranks(request.island_id)), \
                self.streams.open("fetch", credential, context.cancel) as ticket:
            # The leader's reads for its evaluation are the coordinator's own, not the run's traffic.
            yield from self._result(request.island_id or "observer", None, ranges, fragment, context=context, ticket=ticket,
                                    counted=not leader)

    @_refusals
    def PushPseudoGradient(self, request_iterator: Iterator[pb.PushMessage], context) -> pb.PushResponse:
        limits = self.state.cfg.limits
        request_iterator = idle_bounded(request_iterator, limits.push_idle_s, limits.push_floor_mbps * 125_000)
        first = next(request_iterator, None)
        if first is None or isinstance(first, ChunkView) or not first.HasField("header"):
            raise Refused(Reason.BAD_REQUEST, "a push must start with a PushHeader")

        def chunks() -> Iterator[pb.TensorChunk]:
            n = 0
            for message in request_iterator:
                if isinstance(message, ChunkView):  # parsed by hand (diloco/wire/frames.py): its payload not copied
                    n += 1
                    yield message
                    continue
                kind = message.WhichOneof("kind")
                if kind == "end":
                    if message.end.chunks != n or next(request_iterator, None) is not None:
                        raise Refused(Reason.BAD_REQUEST, f"PushEnd counts {message.end.chunks} chunks, the stream carried {n} "
                                      "(or went on after it)")
                    # Whole: kept only if its process is still the island's (a join replacing it waits for this one).
                    self.state.members.begin_attach(h.island_id, instance)
                    attaching.append(h.island_id)
                    return
                if kind != "chunk":
                    raise Refused(Reason.BAD_REQUEST, "only chunks and then a PushEnd may follow the PushHeader")
                n += 1
                yield message.chunk
            # A cancelled call can end the iterator like a clean half-close: without PushEnd, nothing is kept.
            raise Refused(Reason.BAD_REQUEST, f"the push stream ended after {n} chunks without its PushEnd (cut off?); "
                          "nothing of it was kept: push again")

        self._caller(context, first.header.island_id)
        h, instance, attaching = first.header, instance_from(context.invocation_metadata()), []
        with self.limits.stream("push", h.island_id, self._ranks(h.island_id)):
            try:
                with self.state.push_slots.slot(h.island_id, lambda: context.is_active() and not self.stop.is_set()):
                    context.send_initial_metadata(PUSH_ADMITTED)  # the island sends its chunks from now on
                    try:
                        response = self.state.receive(h, chunks())
                    finally:
                        for island_id in attaching:
                            self.state.members.end_attach(island_id)
            except Abandoned as e:  # as when the coordinator stops mid-push: the island pushes again to its restart
                context.abort(grpc.StatusCode.CANCELLED, str(e))
        self.audit.record("push", island=h.island_id, round=h.round, fragment=h.fragment, tokens=h.tokens, elements=response.elements,
                          complete=response.contribution_complete, **self._who(context))
        return response

    @_refusals
    def PullRoundResult(self, request: pb.PullRequest, context) -> Iterator[pb.ResultMessage]:
        credential = self._caller(context, request.island_id)
        instance = instance_from(context.invocation_metadata())
        self.state.touch(request.island_id)
        ranges = self._ranges(request.ranges, request.fragment)
        if not 0 <= request.timeout_s < math.inf:  # NaN too: a wait that never ends, or ends at once for ever
            raise Refused(Reason.BAD_REQUEST, f"timeout_s must be a finite number of seconds >= 0, got {request.timeout_s}")
        # Counted from the wait on: a waiting pull holds one of the server's threads.
        with self.limits.stream("result", request.island_id, self._ranks(request.island_id)), \
                self.streams.open("pull", credential, context.cancel) as ticket:
            held = self.state.wait_for_result(request.island_id, request.round, min(request.timeout_s or 600.0, 3600.0),
                                              request.fragment, ranges,
                                              lambda: ticket.revoked or self.state.members.superseded(request.island_id, instance))
            ticket.check()
            self.state.members.check_instance(request.island_id, instance)  # replaced while it waited
            yield from self._result(
                request.island_id, request.round if request.accept_delta else None, ranges, request.fragment, request.want_mean, held,
                context, ticket,
            )

    @_refusals
    def Leave(self, request: pb.LeaveRequest, context) -> pb.LeaveResponse:
        self._caller(context, request.island_id)
        stats = {
            "compute_s": request.compute_s, "wait_s": request.wait_s, "straggler_s": request.straggler_s,
            "wall_s": request.wall_s, "inner_steps": request.inner_steps,
            "steady_compute_s": request.steady_compute_s, "steady_wall_s": request.steady_wall_s,
        }
        # Kept in the island's record and logged: bounded. One checksum more than the fragments still differs.
        checksums = [bounded(c, CHECKSUM_MAX) for c in request.fragment_checksums[: len(self.state.fragments) + 1]]
        matches, whole = self.state.leave(bounded(request.island_id, ID_MAX), bounded(request.checksum, CHECKSUM_MAX), stats,
                                          checksums, untrained=ranges_of(request.untrained))
        self.limits.forget(request.island_id)
        self.audit.record("leave", island=bounded(request.island_id, ID_MAX), checksum_matches=matches, **self._who(context))
        return pb.LeaveResponse(checksum_matches=matches, checksum=whole)

    @_refusals
    def Lease(self, request: pb.LeaseRequest, context) -> pb.LeaseResponse:
        ledger = self.state.ledger
        if ledger is None:
            raise Refused(Reason.BAD_REQUEST, "this run reads no token corpus (data.source is not 'tokens'): there is nothing to lease")
        self._caller(context, request.island_id)
        if not self.state.members.is_known(request.island_id):  # an allowance is an island's: no fresh ids to lease under
            raise Refused(Reason.NOT_A_MEMBER, f"unknown island {bounded(request.island_id, ID_MAX)!r}: join first")
        ranges = ledger.lease(request.island_id, request.index, request.samples, self.state.canonical_members(),
                              lease_bound(self.state.cfg, self._ranks(request.island_id)))
        return pb.LeaseResponse(index=request.index, ranges=[pb.SampleRange(start=a, stop=b) for a, b in ranges])

    @_refusals
    def Judge(self, request: pb.JudgeRequest, context) -> pb.JudgeResponse:
        why = "this coordinator is not a leading shard" if self.judges is None else self.judges.refusal(request)
        if why is not None:
            raise Refused(Reason.NOT_YOURS, f"only the coordinator's own shards may send the leading shard a round's "
                          f"statistics (signed with DILOCO_SHARD_SECRET): {why}")
        self.state.fragment(request.fragment)  # refuses a fragment that does not exist
        pieces = max(1, request.pieces)
        if not (0 <= request.piece < pieces <= MAX_PIECES):
            raise Refused(Reason.BAD_REQUEST, f"piece {request.piece} of {request.pieces} (at most {MAX_PIECES} pieces)")
        verdict = self.judges.judge(request.fragment, request.round, request.shard, list(request.contributions),
                                    request.piece, pieces)
        return pb.JudgeResponse() if verdict is None else verdict_proto(verdict)

    @_refusals
    def CloseRound(self, request: pb.CloseRoundRequest, context) -> pb.CloseRoundResponse:
        """The leading shard closed a round (coordinator/judging.py CloseNotices): this following shard closes it too."""
        follower = self.shard is not None and not self.shard.leads
        why = (close_refusal(self.shard.secret, self.shard.index, request) if follower
               else "this coordinator is not a following shard")
        if why is not None:
            raise Refused(Reason.NOT_YOURS, f"only the coordinator's leading shard may close a following shard's round "
                          f"(signed with DILOCO_SHARD_SECRET): {why}")
        if request.roll_back:
            self.rollback.request(f"the leading shard rolls the shards back: {request.roll_back_reason}")
        else:
            self.state.fragment(request.fragment).leader_closed(request.round, list(request.islands))
        return pb.CloseRoundResponse()

    @_refusals
    def WatchRounds(self, request: pb.WatchRequest, context) -> Iterator[pb.RoundSummary]:
        """Round summaries as rounds close. Each watch holds a server thread for as long as it lasts: a revoked
        credential is refused, and watches are bounded per credential and in all (coordinator/streams.py)."""
        credential = None if self._leader_reads(request) else self._credential(context)
        with self.streams.open("watch", credential, context.cancel) as ticket:
            # A caller gone frees its thread (is_active); a revoked one is refused within half a second (check).
            yield from self.state.watch(request.from_round, self.stop, context.is_active, ticket.check)


def add_to_server(service: CoordinatorService, server: grpc.Server) -> None:
    """The generated registration, except that result streams also take messages serialized already, and a
    push's chunk messages arrive as ChunkViews (diloco/wire/frames.py)."""

    class Capture:
        def add_generic_rpc_handlers(self, handlers) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            self.name, self.handlers = name, handlers

    capture = Capture()
    pb_grpc.add_CoordinatorServicer_to_server(service, capture)
    handlers = dict(capture.handlers)
    for method in ("FetchParameters", "PullRoundResult"):
        handlers[method] = handlers[method]._replace(response_serializer=serialized)
    handlers["PushPseudoGradient"] = handlers["PushPseudoGradient"]._replace(
        request_deserializer=chunk_deserializer(pb.PushMessage, (2,)))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.name, handlers),))
    server.add_registered_method_handlers(capture.name, handlers)
