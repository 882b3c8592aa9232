"""Runs a coordinator: the gRPC server, the health service and the round driver."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator import durable
from coordinator.audit import AuditLog, NoAudit
from coordinator.ledger import DataLedger, account_dict
from coordinator.limits import max_message_bytes
from coordinator.metrics import CheckpointStats, coordinator_metrics
from coordinator.rounds import Closed, FragmentRounds, RoundDriver
from coordinator.runlog import RunLog
from coordinator.service import CoordinatorService, add_to_server
from coordinator.sharding import ShardRole, ShardServices
from coordinator.spool import SpoolDir
from coordinator.state import CoordinatorState
from coordinator.web import RunWebServer
from diloco.checkpoint import CheckpointStore
from diloco.config import RunConfig
from diloco.data.sources import eval_batches, open_corpus, resolve_vocab
from diloco.inner import evaluate
from diloco.models.evaluation import make_task_evaluator
from diloco.models.llama import Transformer
from diloco.models.llama import initial_parameters as model_parameters
from diloco.params import load_parameters
from diloco.security.credentials import RevocationList, TlsFiles
from diloco.security.net import is_loopback

log = logging.getLogger(__name__)

SERVICE_NAME = "diloco.v1.Coordinator"


def initial_parameters(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """The run's starting point: the model initialised from the run seed, in fp32 (made one parameter at a time)."""
    return model_parameters(cfg.model, cfg.seed)


def make_evaluator(cfg: RunConfig):
    """Eval loss of the global parameters on the fixed held-out batches (None if disabled)."""
    if cfg.eval.batches <= 0:
        return None
    batches = eval_batches(cfg.data, cfg.eval.batches, cfg.eval.batch_size, cfg.model.vocab_size)
    model = Transformer(cfg.model)

    def run(params: dict[str, torch.Tensor]) -> float:
        load_parameters(model, params)
        return evaluate(model, batches)

    return run


@dataclass
class Observe:
    """What a coordinator shows of its run: the dashboard and metrics port, JSON lines per round, TensorBoard."""

    http_host: str = "127.0.0.1"
    http_port: int | None = None  # None: no HTTP port; 0: any free one
    log_url: str = ""  # JSON lines, one per round (a folder or s3://...)
    tensorboard: str = ""  # a TensorBoard log folder


@dataclass
class Coordinator:
    """A running coordinator. stop() shuts it down; wait() blocks until the run has finished."""

    state: CoordinatorState
    server: grpc.Server
    port: int
    stop_event: threading.Event
    driver: RoundDriver  # one round-driver thread per fragment
    health: health.HealthServicer
    audit: AuditLog | NoAudit = field(default_factory=NoAudit)
    checkpoints: CheckpointStats = field(default_factory=CheckpointStats)
    web: RunWebServer | None = None
    runlog: RunLog | None = None
    shard_services: ShardServices | None = None  # a shard of several: what makes the shards one run
    made_spool: SpoolDir | None = None  # a spool directory this coordinator made (none was given): removed at stop

    def wait(self, timeout: float | None = None) -> bool:
        return self.driver.wait(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.stop_event.set()
        self.health.enter_graceful_shutdown()
        if not self.server.stop(grace_s).wait(grace_s + 30):  # gRPC can leave a call unfinished; stop anyway
            log.warning("the gRPC server had not stopped %gs after stop(); going on", grace_s + 30)
        self.driver.wait(5.0)
        self.audit.close()
        if self.web is not None:
            self.web.stop()
        if self.runlog is not None:
            self.runlog.close()
        if self.shard_services is not None:
            self.shard_services.close()
        if self.made_spool is not None:  # its pushes are folded or lost with the process; nothing resumes from it
            self.made_spool.remove()

    def report(self) -> dict:
        s = self.state
        return {
            "rounds": [
                {
                    "round": r.round,
                    "fragment": r.fragment,
                    "islands": list(r.islands),
                    "dropped": list(r.dropped),
                    "tokens": r.tokens,
                    "train_loss": r.train_loss,
                    "eval_loss": None if math.isnan(r.eval_loss) else r.eval_loss,
                    "bytes_up": r.bytes_up,
                    "bytes_down": r.bytes_down,
                    "ddp_bytes": r.ddp_bytes,
                    "traffic": {t.island_id: [t.bytes_up, t.bytes_down] for t in r.traffic},
                    "seconds": r.seconds,
                    "checksum": r.checksum,
                    "elements_folded": r.elements_folded,
                    "elements_expected": r.elements_expected,
                    "clipped": list(r.clipped),
                    **({"data": account_dict(r.data)} if r.HasField("data") else {}),
                }
                for r in s.summaries
            ],
            "initial_eval_loss": None if math.isnan(s.initial_eval_loss) else s.initial_eval_loss,
            "checksum": s.checksum,
            "final_round": s.round,
            "codec": s.codec.name,
            "downlink_codec": s.publication.codec.name,
            "fragments": len(s.fragments),
            "fragment_rounds": [f.round for f in s.fragments],
            "islands": {i.island_id: i.final_checksum for i in s.departed},
            "island_stats": {i.island_id: i.stats for i in s.departed},
            "events": dataclasses.asdict(s.events),
            "data": s.data_report(),
            # What the coordinator held, by component (coordinator/memory.py): now, and the peaks over the rounds.
            "memory": s.memory_report(),
        }


def initial_eval_text(loss: float, shard: ShardRole | None) -> str:
    """The initial eval loss as logged: a following shard holds a part of the model and evaluates nothing."""
    if shard is not None and not shard.leads:
        return "evaluated by shard 0"
    return f"{loss:.4f}"


def save(state: CoordinatorState, store: CheckpointStore, stats: CheckpointStats) -> None:
    """Writes a checkpoint; a failure is logged and counted, and the run goes on (the next one may succeed)."""
    started = time.perf_counter()
    try:
        durable.save(state, store)
        stats.record(time.perf_counter() - started, ok=True)
    except Exception as e:  # storage trouble must not stop the round driver
        stats.record(time.perf_counter() - started, ok=False)
        log.error("checkpoint to %s failed (%s: %s); the run goes on and the next checkpoint tries again",
                  store.url, type(e).__name__, e)


# A connection that has not finished its handshake (TLS, then HTTP/2's preface) this long after it opened is closed:
# gRPC's default is 120 s, so anyone who reaches the port, certificate or not, held a file descriptor per idle TCP
# connection for two minutes (1,100 of them exhausted a limit of 1,024: no island could connect, no spool open). An
# island's handshake takes a few round trips.
HANDSHAKE_TIMEOUT_S = 5.0


# Open files a coordinator should be allowed: each island's connection and each push being spooled to disk takes one,
# and a burst of connections takes one each until the handshake limit closes them.
SENSIBLE_OPEN_FILES = 4096


def raise_open_file_limit(sensible: int = SENSIBLE_OPEN_FILES) -> int:
    """Raises this process's soft limit on open files (RLIMIT_NOFILE) to its hard limit, as servers do: the common
    default of 1,024 is a few hundred islands' connections and spools. Logs one line saying what to run when the
    limit is still below `sensible`. Returns the soft limit now (-1 where there are no such limits)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("open files: soft limit raised from %d to %d", soft, target)
            soft = target
        except (ValueError, OSError) as e:
            log.debug("could not raise the soft limit on open files from %d to %d: %s", soft, target, e)
    if soft != resource.RLIM_INFINITY and soft < sensible:
        log.warning("the coordinator may have only %d files open (RLIMIT_NOFILE; hard limit %s): each island's connection "
                    "and spooled push takes one, so islands may fail to connect; start it with a higher limit: `ulimit -n %d` "
                    "in its shell (above the hard limit that needs root or /etc/security/limits.conf), or LimitNOFILE=%d in "
                    "its systemd unit", soft, "none" if hard == resource.RLIM_INFINITY else hard, 16 * sensible, 16 * sensible)
    return soft


def server_options(cfg: RunConfig) -> list[tuple[str, int]]:
    """The gRPC server's options: the largest message (max_message_bytes), the handshake's time limit and the
    receive window."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes(cfg)),
        ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
    ] + receive_window(cfg.limits.receive_window_mb)


def receive_window(mb: float) -> list[tuple[str, int]]:
    """Each incoming stream's HTTP/2 receive window fixed at mb MiB (limits.receive_window_mb); 0: gRPC's probing."""
    if mb <= 0:
        return []
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", int(mb * 2**20))]


def open_ledger(cfg: RunConfig) -> tuple[DataLedger | None, str]:
    """With a token corpus: who trains on which samples (coordinator/ledger.py) and the corpus's digest. cfg's
    vocabulary is resolved already (start_coordinator)."""
    if cfg.data.source != "tokens":
        return None, ""
    corpus = open_corpus(cfg.data, cfg.seed, cfg.model.vocab_size)
    ledger = DataLedger(corpus.samples.epoch_size, cfg.data.seq_len, cfg.streaming.fragments)
    corpus.samples.store.close()
    log.info("token corpus %s: %d samples of %d tokens an epoch, vocabulary %d", cfg.data.url,
             corpus.samples.epoch_size, cfg.data.seq_len, corpus.vocab_size)
    return ledger, corpus.digest


def start_grpc(cfg: RunConfig, service: CoordinatorService, host: str, port: int,
               credentials: grpc.ServerCredentials | None) -> tuple[grpc.Server, int, health.HealthServicer]:
    """The gRPC server with the service and health checks, serving on host:port; returns it and the bound port."""
    # Every island holds a thread while it waits for a round to close.
    # No message an island sends is larger than a chunk and its framing: bigger ones are refused by gRPC
    # itself (RESOURCE_EXHAUSTED) before they are read into memory.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2 * cfg.rounds.max_islands + 16),
                         options=server_options(cfg))
    add_to_server(service, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
             else server.add_insecure_port(f"{host}:{port}"))
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}; is the port in use?")
    server.start()
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def start_coordinator(
    cfg: RunConfig, host: str = "127.0.0.1", port: int = 0, spool_dir: str | None = None, resume: bool = False,
    tls: TlsFiles | None = None, insecure: bool = False, revocations: RevocationList | None = None, audit_url: str = "",
    observe: Observe | None = None, shard: ShardRole | None = None,
) -> Coordinator:
    """Starts serving on host:port (port 0 picks a free one) and returns at once.

    With shard, this process is one shard of a coordinator of several (docs/sharding.md): it holds only its part
    of the global parameters, checkpoints it under checkpoint.url/shard-I-of-K, and only the leading shard (0)
    keeps the token ledger. Nobody holds the whole model, so nobody evaluates it.

    With resume, state comes from the newest committed checkpoint at
    cfg.checkpoint.url (a fresh run if there is none yet). With tls, the port
    speaks mutual TLS: every caller shows a client certificate of the run's CA,
    whose name binds it to the islands it makes (revocations: names refused
    from then on). Plaintext on anything but loopback needs insecure.
    """
    if tls is None and not is_loopback(host):
        if not insecure:
            raise ValueError(f"the coordinator would serve {host}:{port} in plaintext: give it the run's certificates "
                             "(--tls DIR, made by `diloco-certs init`), or --insecure on a network you trust")
        log.warning("serving %s:%d in PLAINTEXT (--insecure): anyone who reaches the port can act as any island", host, port)
    credentials = None
    if tls is not None:
        ca, cert, key = tls.read()
        credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    made_spool = None if spool_dir else SpoolDir.make()
    spool = Path(spool_dir) if spool_dir else made_spool.path
    spool.mkdir(parents=True, exist_ok=True)
    # On every shard, not only the one keeping the ledger: the model's shapes and the config digest islands are checked
    # against both follow the vocabulary (model.vocab_size = 0 takes the corpus's).
    resolve_vocab(cfg)
    ledger, data_digest = open_ledger(cfg) if shard is None or shard.leads else (None, "")
    whole = shard is None or shard.count == 1
    observe = observe or Observe()
    if not whole:  # every shard is given the same locations: each writes in a folder of its own
        audit_url = shard.own_url(audit_url)
        observe = dataclasses.replace(observe, log_url=shard.own_url(observe.log_url),
                                      tensorboard=shard.own_url(observe.tensorboard))
    audit = AuditLog(audit_url) if audit_url else NoAudit()
    part, manifests = shard.part(cfg) if shard is not None else ({"params": initial_parameters(cfg)}, [])
    evaluators, services, built = {"evaluate": make_evaluator(cfg), "tasks": make_task_evaluator(cfg)}, None, []
    if not whole:  # judged, summarised and evaluated as one run (coordinator/sharding.py ShardServices)
        fragments = lambda: built[0].fragments if built else []  # the state's, once it exists
        services = ShardServices.start(shard, cfg, tls, manifests, fragments)
        part |= services.state_args()
        evaluators = services.evaluators(evaluators["evaluate"], evaluators["tasks"], lambda: initial_parameters(cfg), fragments)
    state = CoordinatorState(cfg, spool_dir=spool, ledger=ledger, data_digest=data_digest,
                             revoked=revocations.is_revoked if revocations is not None else (lambda owner: False),
                             record=audit.record, **evaluators, **part)
    built.append(state)
    url = cfg.checkpoint.url if whole else shard.own_url(cfg.checkpoint.url)
    store = CheckpointStore(url, keep_last=cfg.checkpoint.keep_last) if url else None
    if resume:
        if store is None:
            raise ValueError("--resume needs a checkpoint location: set checkpoint.url (e.g. --set checkpoint.url=s3://bucket/run)")
        # Shards resume from the newest round every one of them committed, so that they agree on it.
        step = shard.common_step(cfg.checkpoint.url, cfg.checkpoint.keep_last) if not whole else None
        if not durable.restore(state, store, step):
            log.warning("no committed checkpoint under %s; starting the run from scratch", url)
    if services is not None:
        services.restored()
    log.info("global parameters: %d tensors, %.2fM elements; initial eval loss %s", len(state.params),
             state.manifest.total_numel() / 1e6, initial_eval_text(state.initial_eval_loss, shard))
    # Before the port opens: a log location that cannot be written is an error at start, not mid-run.
    runlog = RunLog(observe.log_url, observe.tensorboard, cfg) if observe.log_url or observe.tensorboard else None
    stop = threading.Event()
    service = CoordinatorService(state, stop, mutual_tls=tls is not None, audit=audit, shard=shard,
                                 judges=services.judging.leader if services is not None else None,
                                 rollback=services.rollback if services is not None else None)
    server, bound, health_servicer = start_grpc(cfg, service, host, port, credentials)

    saving = threading.Lock()
    checkpoints = CheckpointStats()
    web = None
    if observe.http_port is not None:
        try:
            web = RunWebServer(state, coordinator_metrics(state, checkpoints), observe.http_host, observe.http_port).start()
        except OSError as e:  # a busy dashboard port must not stop a training run
            log.warning("no dashboard or metrics: could not bind %s:%d (%s); pass --http-port 0 for any free port",
                        observe.http_host, observe.http_port, e)
    # Every fragment closing checkpoint.every_rounds rounds (without streaming: every every_rounds rounds). A shard of
    # several counts each fragment's round: restarted, it must resume at the round the others are in, whichever
    # fragment closed last (docs/sharding.md).
    save_every = cfg.checkpoint.every_rounds * (len(state.fragments) if whole else 1)

    def checkpoint(f: FragmentRounds, closed: Closed) -> None:
        rolling_back = services is not None and services.rollback.requested.is_set()
        if not rolling_back and (closed.run_finished or closed.total_rounds % save_every == 0):
            with saving:
                save(state, store, checkpoints)

    def finished(f: FragmentRounds, closed: Closed) -> None:
        if closed.run_finished:
            health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    # After the state's own (evaluation, summaries, memory): the run log, the checkpoint, health.
    state.hooks.closed += [*([lambda f, closed: runlog.record(closed.summary)] if runlog is not None else []),
                           *([checkpoint] if store is not None else []), finished]
    driver = RoundDriver(state.fragments, stop).start()
    log.info("coordinator %sserving on %s:%d (%s)", f"shard {shard.index} of {shard.count} " if shard else "", host, bound,
             "mutual TLS" if tls is not None else "plaintext")
    return Coordinator(state, server, bound, stop, driver, health_servicer, audit, checkpoints, web, runlog, services,
                       made_spool=made_spool)


def serve(
    cfg: RunConfig,
    host: str,
    port: int,
    report_path: str | None,
    linger_s: float,
    port_file: str | None = None,
    resume: bool = False,
    tls: TlsFiles | None = None,
    insecure: bool = False,
    revocations: RevocationList | None = None,
    audit_url: str = "",
    observe: Observe | None = None,
    http_port_file: str | None = None,
    shard: ShardRole | None = None,
) -> None:
    """Serves until the run finishes and islands have left (or linger_s passed), then stops."""
    coordinator = start_coordinator(cfg, host, port, resume=resume, tls=tls, insecure=insecure, revocations=revocations,
                                    audit_url=audit_url, observe=observe, shard=shard)
    if http_port_file and coordinator.web is not None:
        Path(http_port_file).write_text(str(coordinator.web.port))
    if port_file:  # last: whoever waits for it finds the HTTP port written already
        Path(port_file).write_text(str(coordinator.port))
    rollback = coordinator.shard_services.rollback if coordinator.shard_services is not None else None
    try:
        while not coordinator.wait(1.0):
            if rollback is not None:
                rollback.check()  # raises RolledBack: stop, to resume with the other shards
        deadline = time.monotonic() + linger_s
        with coordinator.state.cond:
            coordinator.state.cond.wait_for(lambda: not coordinator.state.islands, max(0.0, deadline - time.monotonic()))
    finally:
        coordinator.stop()
        if report_path:
            Path(report_path).write_text(json.dumps(coordinator.report(), indent=2))
