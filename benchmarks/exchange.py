"""What a round costs: one exchange against a bare gRPC transfer of the same bytes, and the coordinator's memory.

One exchange is every island's push, the close (folding the spooled
contributions), the outer step, the publication and every island's pull, each
island ending on the new global parameters (checksum verified). Measured from
the moment every island starts pushing until the last one holds the result.

Processes: the real coordinator (`python -m coordinator serve`, eval off) in a
process of its own; N islands as threads of this process, each with its own
connection, running the islands' own exchange code (`islands.round.push`
and `pull`, with the real codec). They share one pseudo-gradient (memory) but
each encodes, sends, receives, decodes and verifies its own copy.

The bare transfer (benchmarks/transfer.py): a gRPC server in a process of its
own that only counts what it is sent and streams back pre-built payloads; the same N client threads push
exactly the serialized chunk messages the exchange sends, wait for each other
(as a pull waits for the round to close), and receive messages of the sizes
the coordinator sends. Nothing is encoded, decoded, stored or summed.

Both run on the same machine, over loopback or (--wan) each island behind an
emulated link of its own; each figure is the median of --repeat exchanges
after one warm-up. Peak memory is the coordinator's VmHWM; after the grid a
second table sets beside it what the coordinator accounts for by component
(coordinator/memory.py, read from its /metrics: the most each part held around
the closes), their sum and the remainder (VmHWM less the sum: the runtime,
gRPC's buffers, the allocator's slack). docs/benchmarks.md: "What a round
costs" and "Coordinator memory by component".

With --stagger S island k starts pushing k x S seconds after the first, as
islands that finish their inner steps at different times do; what is measured
then is the close: from the last push's end until every island holds the
result, and how many contributions the coordinator folded while the round was
still open (coordinator/rounds.py FoldAhead).

    python -m benchmarks.exchange --sizes 1m,25m,125m,350m --islands 1,2,4,8 --codecs fp32,int8,e3m0
    python -m benchmarks.exchange --sizes 125m --islands 4 --codecs fp32,e3m0 --stagger 2
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.memory import COMPONENTS
from diloco.cli.common import ArgumentParser, fail
from diloco.config import RunConfig, load_config
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.frames import push_frames
from diloco.wire.messages import FlatRange, Manifest, downlink_codec, tensor_chunks, uplink_codec
from islands.client import CoordinatorClient
from islands.round import Exchange, FragmentShard, Wire, pg_chunks, pull, push
from islands.sim.wan import LinkSpec, WanSpecError, parse_link
from benchmarks.transfer import addresses, measure_bare, peak_rss, release_memory, spawn, stop, timed_cpu

PROG = "exchange"
# name -> (vocab_size, d_model, n_layers, d_ff); parameters counted from the model the coordinator builds
SIZES = {
    # SwiGLU hidden sizes 2/3 of the GELU MLPs these sizes were first measured with: the same parameter counts.
    "1m": (256, 128, 5, 341),
    "25m": (8192, 512, 6, 1365),
    "125m": (50304, 768, 12, 2048),
    "350m": (50304, 1024, 24, 2731),
}


def run_config(size: str, codec: str, islands: int, rounds: int, overrides: tuple[str, ...] = ()) -> RunConfig:
    vocab, d_model, n_layers, d_ff = SIZES[size]
    return load_config(None, [*overrides,
        f"model.vocab_size={vocab}", f"model.d_model={d_model}", f"model.n_layers={n_layers}", f"model.d_ff={d_ff}",
        f"model.n_heads={d_model // 64 if d_model >= 256 else 4}", f"wire.codec={codec}", f"rounds.rounds={rounds}",
        f"rounds.min_islands={islands}", f"rounds.max_islands={islands}", f"data.shards={islands}",
        "rounds.lease_s=3600", "rounds.heartbeat_s=600", "rounds.deadline_s=3600", "eval.batches=0",
    ])  # the benchmark's own settings after the caller's overrides: what it measures stays what it says


class Island:
    """One island's connection and its copy of theta_global; exchanges a shared pseudo-gradient."""

    def __init__(self, address: str, cfg: RunConfig, pg: dict[str, torch.Tensor] | None, client=None):
        """client: a connection made already (benchmarks/shards.py: a sharded coordinator's ShardedClient)."""
        self.client = client or CoordinatorClient(address, connect_timeout_s=600)
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

    def exchange(self, round_: int, delay_s: float = 0.0) -> tuple[int, int, float, float, float, float]:
        """Push (after delay_s) and pull of one round; returns the bytes sent and received, the seconds each took (the
        pull's include the wait for the close), and when the push and the pull ended (perf_counter)."""
        time.sleep(delay_s)
        sent, received = self.client.bytes_sent, self.client.bytes_received
        ex = Exchange(0, round_, 0, 0, self.tokens, 1, 1.0, self.checksum, pusher=True, pg=self.pg)
        started = time.perf_counter()
        if push(self.shard, ex, self.wire) != 1:  # Next.DELIVERED
            raise RuntimeError(f"{self.id}: push of round {round_} refused")
        pushed = time.perf_counter()
        self.checksum = pull(self.shard, ex, self.wire).checksum
        done = time.perf_counter()
        return self.client.bytes_sent - sent, self.client.bytes_received - received, pushed - started, done - pushed, pushed, done


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
    return {**{f"{k}_s": statistics.median(getattr(s, f"{k}_s") for s in summaries) for k in ("fold", "step", "publish")},
            "folded_ahead": statistics.median(s.folded_ahead for s in summaries)}


def rss_now(pid: int) -> int:
    """A process's resident memory now (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def coordinator_memory(http_port: int) -> dict:
    """The coordinator's memory by component (coordinator/memory.py), read from its /metrics: now, the most each
    component held around the closes so far, each at the sample where together they held the most, and the spool
    pool's allocation and bound."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=60) as response:
        text = response.read().decode()
    found: dict[str, dict[str, int]] = {"now": {}, "peak": {}, "at_peak": {}, "pool": {}}
    where = {"diloco_coordinator_memory_bytes": ("now", "component"),
             "diloco_coordinator_memory_peak_bytes": ("peak", "component"),
             "diloco_coordinator_memory_at_peak_bytes": ("at_peak", "component"),
             "diloco_coordinator_spool_pool_bytes": ("pool", "kind")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in where:
                key, label = where[sample.name]
                found[key][sample.labels[label]] = int(sample.value)
    return found


def measure_exchange(cfg: RunConfig, islands: int, repeat: int, workdir: Path, link: LinkSpec | None, stagger_s: float = 0.0) -> dict:
    (workdir / "run.toml").write_text(cfg.to_toml())
    # The dashboard's port (any free one) serves /metrics: the coordinator's memory by component.
    proc, port = spawn(["-m", "coordinator", "serve", "--config", str(workdir / "run.toml"), "--host", "127.0.0.1",
                        "--port", "0", "--log-level", "warning", "--linger", "0", "--http-port", "0",
                        "--http-port-file", str(workdir / "http.port")], workdir, "coordinator")
    where, links = addresses(port, islands, link)
    try:
        base_rss = peak_rss(proc.pid)
        http_port = int((workdir / "http.port").read_text())
        at_start = {"rss": rss_now(proc.pid), **coordinator_memory(http_port)}
        first = Island(where[0], cfg, None)
        members = [first] + [Island(a, cfg, first.pg) for a in where[1:]]
        traffic: dict[int, tuple[int, int, float, float, float, float]] = {}
        seconds, cpu_s, server_cpu_s, push_s, pull_s, tail_s = [], [], [], [], [], []
        delay = {id(m): k * stagger_s for k, m in enumerate(members)}  # --stagger: island k pushes k x stagger_s late
        for round_ in range(repeat + 1):
            def work(island: Island, r: int = round_) -> None:
                traffic[id(island)] = island.exchange(r, delay[id(island)])

            s, cpu, server_cpu = timed_cpu(members, work, proc.pid)
            if round_:  # round 0 warms up: codecs' JIT, connections, first allocations
                seconds.append(s)
                cpu_s.append(cpu)
                server_cpu_s.append(server_cpu)
                push_s.append(max(t[2] for t in traffic.values()))
                pull_s.append(statistics.median(t[3] for t in traffic.values()))
                tail_s.append(max(t[5] for t in traffic.values()) - max(t[4] for t in traffic.values()))
        checksums = {m.checksum for m in members}
        assert len(checksums) == 1, "islands ended on different parameters"
        peak = peak_rss(proc.pid)
        memory = coordinator_memory(http_port)
        for m in members:
            m.client.close()
        up, down = traffic[id(first)][:2]
        close = round_costs(f"127.0.0.1:{port}", repeat)
        return {"seconds": statistics.median(seconds), "all_seconds": seconds, "cpu_s": statistics.median(cpu_s),
                "coordinator_cpu_s": statistics.median(server_cpu_s), "bytes_up": up, "bytes_down": down,
                "peak_rss": peak, "rss_after_start": base_rss, "_first": first, "memory": memory, "memory_at_start": at_start,
                "push_s": statistics.median(push_s), "pull_s": statistics.median(pull_s), "tail_s": statistics.median(tail_s), **close}
    finally:
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


def one(size: str, codec: str, islands: int, repeat: int, link: LinkSpec | None = None, stagger_s: float = 0.0,
        overrides: tuple[str, ...] = ()) -> dict:
    cfg = run_config(size, codec, islands, repeat + 2, overrides)  # the run never finishes under the islands: we stop it
    tmp = Path(tempfile.mkdtemp(prefix="diloco-exchange-"))
    try:
        ex = measure_exchange(cfg, islands, repeat, tmp, link, stagger_s)
        first = ex.pop("_first")
        if stagger_s:  # no bare transfer to compare with: what is measured is the close after the last push
            shutil.rmtree(tmp)
            return {"size": size, "link": str(link) if link else "loopback", "parameters": first.manifest.total_numel(), "codec": codec,
                    "islands": islands, "stagger_s": stagger_s,
                    **{k: ex[k] for k in ("seconds", "tail_s", "fold_s", "folded_ahead", "step_s", "publish_s")}}
        pushed, pulled = messages_of(first, cfg)
        bare = measure_bare(pushed, pulled, islands, repeat, tmp, link)
    except BaseException:
        print(f"{PROG}: {size} {codec} x{islands} failed; logs kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)
    params = first.manifest.total_numel()
    return {
        "size": size, "link": str(link) if link else "loopback", "parameters": params, "codec": codec, "islands": islands,
        "settings": list(overrides), "exchange_s": ex["seconds"],
        "exchange_all_s": ex["all_seconds"], "bare_s": bare["messages_s"], "bare_all_s": bare["messages_all_s"],
        "raw_s": bare["raw_s"], "raw_all_s": bare["raw_all_s"], "ratio": ex["seconds"] / bare["messages_s"],
        # CPU seconds of the islands' and the server's processes: on one machine of C cores an exchange takes at least
        # its CPU / C, so (CPU / C) / bare time is the least ratio any overlap of its parts could reach here.
        "exchange_cpu_s": ex["cpu_s"], "coordinator_cpu_s": ex["coordinator_cpu_s"], "bare_cpu_s": bare["messages_cpu_s"],
        "cores": os.cpu_count(),
        "cpu_floor_ratio": ex["cpu_s"] / os.cpu_count() / bare["messages_s"],
        "bytes_up_per_island": ex["bytes_up"], "bytes_down_per_island": ex["bytes_down"],
        "bare_bytes_up_per_island": sum(m.ByteSize() for m in pushed), "bare_bytes_down_per_island": sum(m.ByteSize() for m in pulled),
        "coordinator_peak_rss": ex["peak_rss"], "coordinator_rss_after_start": ex["rss_after_start"],
        "model_fp32_bytes": 4 * params,
        # The coordinator's memory by component (coordinator/memory.py): the most each held around the closes, now
        # (after the last exchange), the spool pool, and at start with the process's VmRSS then.
        "memory_peak": ex["memory"]["peak"], "memory_at_peak": ex["memory"]["at_peak"], "memory_now": ex["memory"]["now"],
        "spool_pool": ex["memory"]["pool"],
        "memory_at_start": ex["memory_at_start"],
        # Where one exchange's time goes: the slowest island's push; the coordinator's fold, step and publication;
        # an island's pull (from its push's end: the close is inside it). Medians over the measured exchanges.
        **{k: ex[k] for k in ("push_s", "fold_s", "step_s", "publish_s", "pull_s", "folded_ahead")},
    }


def memory_table(rows: list[dict]) -> None:
    """The coordinator's peak memory (VmHWM) beside its parts (coordinator/memory.py COMPONENTS: the most each held
    around the closes; those no point held left out), each in GiB and as a multiple of the fp32 model. Then the sum of
    those peaks (parts need not peak together), the most held at once (the sample whose parts summed the most), and the
    remainder: VmHWM less that (the Python and torch runtime, gRPC's buffers, the allocator's slack, what is held
    between the samples). The runtime alone is read at start: the process's VmRSS then less the parts it held then."""
    shown = [c for c in COMPONENTS if any(r["memory_peak"].get(c, 0) for r in rows)]

    def cell(n: float, model: int) -> str:
        return f"{n / 2**30:.3f} GiB ({n / model:.2f}x)"

    print()
    print("coordinator memory by component: the most each held around the closes, in GiB and x the fp32 model; "
          "remainder = VmHWM - the most held at once; runtime = VmRSS at start - the components then")
    print("| parameters | codec | islands | VmHWM | " + " | ".join(shown)
          + " | sum of the peaks | most held at once | remainder | runtime at start |")
    print("|---|---|---|---|" + "---|" * (len(shown) + 4))
    for r in rows:
        model, peak = r["model_fp32_bytes"], r["memory_peak"]
        at_once = sum(r["memory_at_peak"].values())
        start = r["memory_at_start"]
        runtime = start["rss"] - sum(start["now"].values())
        print(f"| {r['parameters'] / 1e6:.1f}M | {r['codec']} | {r['islands']} | {cell(r['coordinator_peak_rss'], model)} | "
              + " | ".join(cell(peak.get(c, 0), model) for c in shown)
              + f" | {cell(sum(peak.values()), model)} | {cell(at_once, model)} | "
              f"{cell(r['coordinator_peak_rss'] - at_once, model)} | {cell(runtime, model)} |")
    pools = {(r["spool_pool"]["capacity"], r["model_fp32_bytes"]) for r in rows}
    print("spool pool bound: " + ", ".join(cell(c, m) for c, m in sorted(pools)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1m,25m,125m", help=f"model sizes, from {','.join(SIZES)} (default 1m,25m,125m)")
    parser.add_argument("--islands", default="1,2,4,8", help="numbers of islands (default 1,2,4,8)")
    parser.add_argument("--codecs", default="fp32,int8,e3m0", help="uplink codecs (the downlink uses the same; default fp32,int8,e3m0)")
    parser.add_argument("--repeat", type=int, default=3, help="measured exchanges per point, after one warm-up (default 3)")
    parser.add_argument("--wan", metavar="RATE:DELAY", help="each island behind an emulated WAN link of its own, e.g. 1gbit:25ms "
                        "(islands.sim.wan; the bare transfer too); default: plain loopback")
    parser.add_argument("--stagger", type=float, default=0.0, metavar="SECONDS",
                        help="island k starts pushing k x SECONDS after the first, as islands that finish their inner steps at "
                        "different times; measures the close after the last push (what folding ahead takes off it) instead "
                        "of comparing with the bare transfer")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="a coordinator setting, e.g. limits.spool_memory_models=0 (spools on disk only); repeatable. "
                        "The model, codec, islands and rounds are the benchmark's")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here")
    args = parser.parse_args(argv)
    try:
        load_config(None, args.overrides)
    except Exception as e:  # ConfigError or ValueError: a key or value the config does not take
        fail(PROG, f"--set: {e}")
    sizes = args.sizes.split(",")
    if bad := [s for s in sizes if s not in SIZES]:
        fail(PROG, f"--sizes: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    try:
        counts = [int(n) for n in args.islands.split(",")]
    except ValueError:
        fail(PROG, f"--islands: expected numbers such as 1,2,4,8, got {args.islands!r}")
    if any(n < 1 for n in counts) or args.repeat < 1:
        fail(PROG, "--islands and --repeat must be at least 1")
    if not 0 <= args.stagger <= 600:
        fail(PROG, f"--stagger must be between 0 and 600 seconds, got {args.stagger:g}")
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
    where = f"{'each island on an emulated link ' + str(link) if link else 'loopback'}, median of {args.repeat} after a warm-up"
    if args.stagger:
        print(f"{PROG}: islands pushing {args.stagger:g} s apart; {os.cpu_count()} cores, {where}", flush=True)
        print("| parameters | codec | islands | last push's end to every island holding the result | fold at the close "
              "| contributions folded ahead | step, publish |")
        print("|---|---|---|---|---|---|---|", flush=True)
    else:
        print(f"{PROG}: one exchange vs a bare gRPC transfer of the same bytes; {os.cpu_count()} cores, {where}", flush=True)
        print("| parameters | codec | islands | exchange | gRPC, same messages | ratio | gRPC, raw bytes | per island up / down "
              "| coordinator peak RSS (model fp32) | push, fold, step, publish, pull | CPU s, exchange (coordinator's) / bare "
              "| least ratio on these cores |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for size in sizes:
        for codec in codecs:
            for n in counts:
                r = one(size, codec, n, args.repeat, link, args.stagger, tuple(args.overrides))
                release_memory()  # the next point's islands start from what this one freed
                rows.append(r)
                if args.stagger:
                    print(f"| {r['parameters'] / 1e6:.1f}M | {codec} | {n} | {r['tail_s']:.3f} s | {r['fold_s']:.3f} s | "
                          f"{r['folded_ahead']:g} of {n} | {r['step_s']:.3f}, {r['publish_s']:.3f} s |", flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(rows, indent=1))
                    continue
                print(f"| {r['parameters'] / 1e6:.1f}M | {codec} | {n} | {r['exchange_s']:.3f} s | {r['bare_s']:.3f} s | "
                      f"{r['ratio']:.2f}x | {r['raw_s']:.3f} s | {r['bytes_up_per_island'] / 1e6:.1f} / {r['bytes_down_per_island'] / 1e6:.1f} MB | "
                      f"{r['coordinator_peak_rss'] / 2**20:.0f} MiB ({r['model_fp32_bytes'] / 2**20:.0f} MiB) | "
                      f"{', '.join(f'{r[k]:.3f}' for k in ('push_s', 'fold_s', 'step_s', 'publish_s', 'pull_s'))} s | "
                      f"{r['exchange_cpu_s']:.2f} ({r['coordinator_cpu_s']:.2f}) / {r['bare_cpu_s']:.2f} | {r['cpu_floor_ratio']:.2f}x |",
                      flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    if not args.stagger:
        memory_table(rows)


if __name__ == "__main__":
    main()
