"""What a round costs: one exchange against a bare gRPC transfer of the same bytes, and the coordinator's memory.

One exchange is every island's push, the close (folding the spooled
contributions), the outer step, the publication and every island's pull, each
island ending on the new global parameters (checksum verified). Measured from
the moment every island starts pushing until the last one holds the result.

Processes: the real coordinator (`python -m coordinator serve`, eval off) in a
process of its own; N islands as threads of this process, each with its own
connection, running the islands' own exchange code (`islands.exchange.push`
and `pull`, with the real codec). They share one pseudo-gradient (memory) but
each encodes, sends, receives, decodes and verifies its own copy.

The bare transfer: a gRPC server in a process of its own that only counts what
it is sent and streams back pre-built payloads; the same N client threads push
exactly the serialized chunk messages the exchange sends, wait for each other
(as a pull waits for the round to close), and receive messages of the sizes
the coordinator sends. Nothing is encoded, decoded, stored or summed.

Both run on the same machine, over loopback or (--wan) each island behind an
emulated link of its own; each figure is the median of --repeat exchanges
after one warm-up. Peak memory is the coordinator's VmHWM. README: "What a
round costs".

    python benchmarks/exchange.py --sizes 1m,25m,125m,350m --islands 1,2,4,8 --codecs fp32,int8,e3m0
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from diloco.cli import ArgumentParser, fail  # noqa: E402
from diloco.config import RunConfig, load_config  # noqa: E402
from diloco.v1 import diloco_pb2 as pb  # noqa: E402
from diloco.v1 import diloco_pb2_grpc as pb_grpc  # noqa: E402
from diloco.frames import push_frames  # noqa: E402
from diloco.wire import FlatRange, Manifest, downlink_codec, tensor_chunks, uplink_codec  # noqa: E402
from islands.client import CoordinatorClient  # noqa: E402
from islands.exchange import Exchange, FragmentShard, Wire, pg_chunks, pull, push  # noqa: E402
from islands.sim.wan import LinkSpec, WanLink, WanSpecError, parse_link  # noqa: E402

PROG = "exchange"
# name -> (vocab_size, d_model, n_layers, d_ff); parameters counted from the model the coordinator builds
SIZES = {
    # SwiGLU hidden sizes 2/3 of the GELU MLPs these sizes were first measured with: the same parameter counts.
    "1m": (256, 128, 5, 341),
    "25m": (8192, 512, 6, 1365),
    "125m": (50304, 768, 12, 2048),
    "350m": (50304, 1024, 24, 2731),
}
BARE_SERVICE = "diloco.bench.Bare"


def run_config(size: str, codec: str, islands: int, rounds: int) -> RunConfig:
    vocab, d_model, n_layers, d_ff = SIZES[size]
    return load_config(None, [
        f"model.vocab_size={vocab}", f"model.d_model={d_model}", f"model.n_layers={n_layers}", f"model.d_ff={d_ff}",
        f"model.n_heads={d_model // 64 if d_model >= 256 else 4}", f"wire.codec={codec}", f"rounds.rounds={rounds}",
        f"rounds.min_islands={islands}", f"rounds.max_islands={islands}", f"data.shards={islands}",
        "rounds.lease_s=3600", "rounds.heartbeat_s=600", "rounds.deadline_s=3600", "eval.batches=0",
    ])


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _die_with_parent() -> None:
    """A server dies with the benchmark, even one killed outright (out of memory): an orphaned coordinator kept
    its memory and the next sizes ran out of it."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(args: list[str], workdir: Path, name: str) -> tuple[subprocess.Popen, int]:
    port_file = workdir / f"{name}.port"
    log = open(workdir / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, *args, "--port-file", str(port_file)], stdout=log, stderr=subprocess.STDOUT,
                            cwd=REPO_ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 600
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start; see {workdir / (name + '.log')}")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Island:
    """One island's connection and its copy of theta_global; exchanges a shared pseudo-gradient."""

    def __init__(self, address: str, cfg: RunConfig, pg: dict[str, torch.Tensor] | None):
        self.client = CoordinatorClient(address, connect_timeout_s=600)
        joined = self.client.join(cfg.digest(), uplink_codec(cfg.wire).name)
        self.id = joined.island_id
        self.manifest = Manifest.from_proto(joined.parameters)
        self.global_ = {n: torch.empty(s) for n, s in self.manifest.shapes.items()}
        self.checksum = self.client.fetch(self.id, self.global_, self.manifest).checksum
        self.pg = pg if pg is not None else {n: torch.randn(t.numel()) * 1e-3 for n, t in self.global_.items()}
        ranges = [FlatRange(n, 0, t.numel()) for n, t in self.global_.items()]
        self.shard = FragmentShard(0, self.manifest, ranges, True, {}, self.global_)
        self.wire = Wire(self.client, uplink_codec(cfg.wire), cfg.wire.chunk_bytes, None, 600.0, lambda: self.id)
        down = downlink_codec(cfg.wire)
        self.client.codecs[down.name] = down  # as islands/island.py does
        # One inner step's tokens (a claim the coordinator's robust aggregation accepts); equal across islands,
        # so the mean is a division, as with most real rounds.
        self.tokens = cfg.inner.batch_size * cfg.data.seq_len

    def exchange(self, round_: int) -> tuple[int, int, float, float]:
        """Push and pull of one round; returns the bytes sent and received, and the seconds each took (the pull's
        include the wait for the close)."""
        sent, received = self.client.bytes_sent, self.client.bytes_received
        ex = Exchange(0, round_, 0, 0, self.tokens, 1, 1.0, self.checksum, pusher=True, pg=self.pg)
        started = time.perf_counter()
        if push(self.shard, ex, self.wire) != 1:  # PUSHED
            raise RuntimeError(f"{self.id}: push of round {round_} refused")
        pushed = time.perf_counter()
        self.checksum = pull(self.shard, ex, self.wire).checksum
        return self.client.bytes_sent - sent, self.client.bytes_received - received, pushed - started, time.perf_counter() - pushed


def round_costs(address: str, repeat: int) -> dict:
    """The coordinator's own timing of the measured rounds' close (fold, outer step, publication), medians, from
    the round summaries it streams to watchers."""
    channel = grpc.insecure_channel(address)
    try:
        stream = pb_grpc.CoordinatorStub(channel).WatchRounds(pb.WatchRequest(from_round=1), timeout=600)
        summaries = [next(stream) for _ in range(repeat)]
        stream.cancel()
    finally:
        channel.close()
    return {f"{k}_s": statistics.median(getattr(s, f"{k}_s") for s in summaries) for k in ("fold", "step", "publish")}


def addresses(port: int, islands: int, link: LinkSpec | None) -> tuple[list[str], list[WanLink]]:
    """Where each island connects: the server, or an emulated WAN link of its own in front of it."""
    links = [WanLink(("127.0.0.1", port), link).start() for _ in range(islands)] if link else []
    return ([lk.address for lk in links] if links else [f"127.0.0.1:{port}"] * islands), links


def timed(workers: list, work) -> float:
    """Runs work(worker) on one thread per worker, started together; seconds until the last one is done."""
    start = threading.Barrier(len(workers) + 1)
    errors: list[BaseException] = []

    def run(w):
        start.wait()
        try:
            work(w)
        except BaseException as e:  # reported below, after every thread ended
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(1800)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"exchange failed: {errors[:1] or 'a thread did not finish'}")
    return time.perf_counter() - t0


def measure_exchange(cfg: RunConfig, islands: int, repeat: int, workdir: Path, link: LinkSpec | None) -> dict:
    (workdir / "run.toml").write_text(cfg.to_toml())
    proc, port = spawn(["-m", "coordinator", "serve", "--config", str(workdir / "run.toml"), "--host", "127.0.0.1",
                        "--port", "0", "--log-level", "warning", "--linger", "0"], workdir, "coordinator")
    where, links = addresses(port, islands, link)
    try:
        base_rss = peak_rss(proc.pid)
        first = Island(where[0], cfg, None)
        members = [first] + [Island(a, cfg, first.pg) for a in where[1:]]
        traffic: dict[int, tuple[int, int, float, float]] = {}
        seconds, push_s, pull_s = [], [], []
        for round_ in range(repeat + 1):
            def work(island: Island, r: int = round_) -> None:
                traffic[id(island)] = island.exchange(r)

            s = timed(members, work)
            if round_:  # round 0 warms up: codecs' JIT, connections, first allocations
                seconds.append(s)
                push_s.append(max(t[2] for t in traffic.values()))
                pull_s.append(statistics.median(t[3] for t in traffic.values()))
        checksums = {m.checksum for m in members}
        assert len(checksums) == 1, "islands ended on different parameters"
        peak = peak_rss(proc.pid)
        for m in members:
            m.client.close()
        up, down = traffic[id(first)][:2]
        close = round_costs(f"127.0.0.1:{port}", repeat)
        return {"seconds": statistics.median(seconds), "all_seconds": seconds, "bytes_up": up, "bytes_down": down,
                "peak_rss": peak, "rss_after_start": base_rss, "_first": first,
                "push_s": statistics.median(push_s), "pull_s": statistics.median(pull_s), **close}
    finally:
        for lk in links:
            lk.stop()
        stop(proc)


# --- the bare transfer ------------------------------------------------------------------------------


def bare_server(port_file: str) -> None:
    """Counts what it is sent and streams back what it was asked for, built once: as protocol messages
    (parsed and serialized by gRPC, as the coordinator's are) and as raw bytes (nothing parsed)."""
    built: dict[tuple[str, bytes], list] = {}

    def push(requests, context):
        return sum(1 for _ in requests).to_bytes(8, "little")

    def pull_messages(request, context):
        if ("m", request) not in built:  # request: (name, offset, numel, payload bytes, xxh3) per chunk, as JSON
            built["m", request] = [pb.ResultMessage(chunk=pb.TensorChunk(name=n, offset=o, numel=k, payload=bytes(b), xxh3=c))
                                   for n, o, k, b, c in json.loads(request)]
        yield from built["m", request]

    def pull_raw(request, context):
        if ("r", request) not in built:  # request: the message sizes, as JSON
            built["r", request] = [bytes(n) for n in json.loads(request)]
        yield from built["r", request]

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "PushMessages": grpc.stream_unary_rpc_method_handler(push, request_deserializer=pb.PushMessage.FromString),
        "PullMessages": grpc.unary_stream_rpc_method_handler(pull_messages, response_serializer=pb.ResultMessage.SerializeToString),
        "PushRaw": grpc.stream_unary_rpc_method_handler(push),
        "PullRaw": grpc.unary_stream_rpc_method_handler(pull_raw),
    })])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def measure_bare(pushed: list[pb.PushMessage], pulled: list[pb.ResultMessage], islands: int, repeat: int,
                 workdir: Path, link: LinkSpec | None) -> dict:
    proc, port = spawn([__file__, "--bare-server"], workdir, "bare")
    where, links = addresses(port, islands, link)
    channels = [grpc.insecure_channel(a) for a in where]
    spec = [pulled[0].ByteSize()] + [m.ByteSize() for m in pulled[1:]]
    chunk_spec = json.dumps([(m.chunk.name, m.chunk.offset, m.chunk.numel, len(m.chunk.payload), m.chunk.xxh3) for m in pulled[1:]])
    raw_pushed = [m.SerializeToString() for m in pushed]
    try:
        both = threading.Barrier(islands)

        def by_messages(channel) -> None:
            push_ = channel.stream_unary(f"/{BARE_SERVICE}/PushMessages", request_serializer=pb.PushMessage.SerializeToString)
            assert int.from_bytes(push_(iter(pushed), timeout=1800), "little") == len(pushed)
            both.wait()  # a pull waits for the round to close
            pull_ = channel.unary_stream(f"/{BARE_SERVICE}/PullMessages", response_deserializer=pb.ResultMessage.FromString)
            assert sum(1 for _ in pull_(chunk_spec.encode(), timeout=1800)) == len(pulled) - 1

        def by_bytes(channel) -> None:
            assert int.from_bytes(channel.stream_unary(f"/{BARE_SERVICE}/PushRaw")(iter(raw_pushed), timeout=1800), "little") == len(pushed)
            both.wait()
            assert sum(map(len, channel.unary_stream(f"/{BARE_SERVICE}/PullRaw")(json.dumps(spec).encode(), timeout=1800))) == sum(spec)

        messages = [timed(channels, by_messages) for _ in range(repeat + 1)][1:]
        raw = [timed(channels, by_bytes) for _ in range(repeat + 1)][1:]
        return {"messages_s": statistics.median(messages), "raw_s": statistics.median(raw), "messages_all_s": messages, "raw_all_s": raw}
    finally:
        for c in channels:
            c.close()
        for lk in links:
            lk.stop()
        stop(proc)


def messages_of(first: Island, cfg: RunConfig) -> tuple[list[pb.PushMessage], list[pb.ResultMessage]]:
    """The messages one island pushes, and messages like those the coordinator sends back (header first)."""
    ex = Exchange(0, 0, 0, 0, first.tokens, 1, 1.0, first.checksum, pusher=True, pg=first.pg)
    header = pb.PushHeader(island_id=first.id, tokens=first.tokens, codec=first.wire.codec.name)
    pushed = [pb.PushMessage.FromString(m) for m in push_frames(header, pg_chunks(first.shard, ex, first.wire))]  # the same bytes
    codec = downlink_codec(cfg.wire)  # fp32: the values; a lossy codec: the update
    pulled = [pb.ResultMessage(header=pb.ResultHeader(round=1, checksum="0" * 32, codec=codec.name))]
    pulled += [pb.ResultMessage(chunk=c) for c in tensor_chunks(first.pg, codec, cfg.wire.chunk_bytes)]
    return pushed, pulled


def one(size: str, codec: str, islands: int, repeat: int, link: LinkSpec | None = None) -> dict:
    cfg = run_config(size, codec, islands, repeat + 2)  # the run never finishes under the islands: we stop it
    tmp = Path(tempfile.mkdtemp(prefix="diloco-exchange-"))
    try:
        ex = measure_exchange(cfg, islands, repeat, tmp, link)
        first = ex.pop("_first")
        pushed, pulled = messages_of(first, cfg)
        bare = measure_bare(pushed, pulled, islands, repeat, tmp, link)
    except BaseException:
        print(f"{PROG}: {size} {codec} x{islands} failed; logs kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)
    params = first.manifest.total_numel()
    return {
        "size": size, "link": str(link) if link else "loopback", "parameters": params, "codec": codec, "islands": islands, "exchange_s": ex["seconds"],
        "exchange_all_s": ex["all_seconds"], "bare_s": bare["messages_s"], "bare_all_s": bare["messages_all_s"],
        "raw_s": bare["raw_s"], "raw_all_s": bare["raw_all_s"], "ratio": ex["seconds"] / bare["messages_s"],
        "bytes_up_per_island": ex["bytes_up"], "bytes_down_per_island": ex["bytes_down"],
        "bare_bytes_up_per_island": sum(m.ByteSize() for m in pushed), "bare_bytes_down_per_island": sum(m.ByteSize() for m in pulled),
        "coordinator_peak_rss": ex["peak_rss"], "coordinator_rss_after_start": ex["rss_after_start"],
        "model_fp32_bytes": 4 * params,
        # Where one exchange's time goes: the slowest island's push; the coordinator's fold, step and publication;
        # an island's pull (from its push's end: the close is inside it). Medians over the measured exchanges.
        **{k: ex[k] for k in ("push_s", "fold_s", "step_s", "publish_s", "pull_s")},
    }


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1m,25m,125m", help=f"model sizes, from {','.join(SIZES)} (default 1m,25m,125m)")
    parser.add_argument("--islands", default="1,2,4,8", help="numbers of islands (default 1,2,4,8)")
    parser.add_argument("--codecs", default="fp32,int8,e3m0", help="uplink codecs (the downlink uses the same; default fp32,int8,e3m0)")
    parser.add_argument("--repeat", type=int, default=3, help="measured exchanges per point, after one warm-up (default 3)")
    parser.add_argument("--wan", metavar="RATE:DELAY", help="each island behind an emulated WAN link of its own, e.g. 1gbit:25ms "
                        "(islands.sim.wan; the bare transfer too); default: plain loopback")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here")
    parser.add_argument("--bare-server", metavar="PORT_FILE", nargs="?", const="", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bare_server is not None:
        return bare_server(args.port_file)
    sizes = args.sizes.split(",")
    if bad := [s for s in sizes if s not in SIZES]:
        fail(PROG, f"--sizes: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    try:
        counts = [int(n) for n in args.islands.split(",")]
    except ValueError:
        fail(PROG, f"--islands: expected numbers such as 1,2,4,8, got {args.islands!r}")
    if any(n < 1 for n in counts) or args.repeat < 1:
        fail(PROG, "--islands and --repeat must be at least 1")
    link = None
    if args.wan:
        try:
            link = parse_link(args.wan)
        except WanSpecError as e:
            fail(PROG, f"--wan: {e}")
    codecs = args.codecs.split(",")
    for c in codecs:
        try:
            uplink_codec(load_config(None, [f"wire.codec={c}"]).wire)
        except Exception as e:  # ConfigError or ValueError, with the codecs there are
            fail(PROG, f"--codecs: {e}")
    print(f"{PROG}: one exchange vs a bare gRPC transfer of the same bytes; {os.cpu_count()} cores, "
          f"{'each island on an emulated link ' + str(link) if link else 'loopback'}, "
          f"median of {args.repeat} after a warm-up", flush=True)
    print("| parameters | codec | islands | exchange | gRPC, same messages | ratio | gRPC, raw bytes | per island up / down "
          "| coordinator peak RSS (model fp32) | push, fold, step, publish, pull |")
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for size in sizes:
        for codec in codecs:
            for n in counts:
                r = one(size, codec, n, args.repeat, link)
                rows.append(r)
                print(f"| {r['parameters'] / 1e6:.1f}M | {codec} | {n} | {r['exchange_s']:.3f} s | {r['bare_s']:.3f} s | "
                      f"{r['ratio']:.2f}x | {r['raw_s']:.3f} s | {r['bytes_up_per_island'] / 1e6:.1f} / {r['bytes_down_per_island'] / 1e6:.1f} MB | "
                      f"{r['coordinator_peak_rss'] / 2**20:.0f} MiB ({r['model_fp32_bytes'] / 2**20:.0f} MiB) | "
                      f"{', '.join(f'{r[k]:.3f}' for k in ('push_s', 'fold_s', 'step_s', 'publish_s', 'pull_s'))} s |", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
