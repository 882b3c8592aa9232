"""What a sharded coordinator costs per shard: peak memory, the exchange's time, CPU and bytes against K shards.

For each model size, K (--shards) and number of islands: K coordinator shard
processes (`python -m coordinator serve --shard I --shards K --shard-addresses
...`, as torchrun or SLURM start them, one shared secret; eval off) and N
islands as threads of this process, each joining the leading shard through its
own ShardedClient (islands/sharded.py) and exchanging with every shard at once
with the islands' own code (`islands.round.push` and `pull`, the real codec),
all sharing one pseudo-gradient as benchmarks/exchange.py's islands do. One
exchange: every island pushes, the shards close, every island pulls (joined
checksum verified equal across islands); the median of --repeat after a warm-up.

Per shard: its peak RSS (VmHWM) after the exchanges, its VmRSS and VmHWM just
after start, each also as a multiple of the fp32 model's bytes (4 x parameters),
with the max and sum over shards; its CPU seconds per exchange; the messages'
bytes it was sent and sent back per exchange, summed over islands (the
islands' per-shard client counters: chunks and headers, not gRPC's framing);
and this process's peak RSS over the point (the islands), so that the shards'
sum plus it is what the machine had to hold.

    python -m benchmarks.shards --sizes 125m --shards 1,2,4 --islands 1,4
    python -m benchmarks.shards --sizes 750m --shards 1,2,4 --islands 1 --out shards-750m.json   # 20.2 GiB of host
    python -m benchmarks.shards --sizes 1b --shards 1,2,4 --islands 1   # about 28 GiB: a host of 32 GiB or more
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import exchange
from benchmarks.exchange import Island, rss_now
from benchmarks.transfer import (
    cpu_seconds,
    peak_rss,
    release_memory,
    spawn,
    stop,
    timed,
)
from coordinator.launch import SECRET_ENV, shard_ports
from diloco.cli.common import ArgumentParser, fail
from diloco.config import ConfigError, RunConfig, config_from_dict, load_config
from diloco.wire.messages import uplink_codec
from islands.client import CoordinatorClient
from islands.memwatch import PeakRss
from islands.sharded import ShardedClient

PROG = "shards"
# exchange.py's sizes, two of about 0.5B and 0.75B (the largest a 24 GiB host holds with K = 4) and configs/1b.toml's
# shape: name -> (vocab_size, d_model, n_layers, d_ff)
SIZES = {**exchange.SIZES, "530m": (50304, 1280, 24, 3413), "750m": (50304, 1536, 24, 4096), "1b": (50304, 2048, 16, 8192)}
KV_HEADS = {"1b": 8}  # grouped-query attention as the preset has it; the rest one key/value head per query head


def run_config(size: str, codec: str, islands: int, rounds: int) -> RunConfig:
    """exchange.run_config's run (its settings, eval off) for a size of SIZES."""
    if size in exchange.SIZES:
        return exchange.run_config(size, codec, islands, rounds)
    vocab, d_model, n_layers, d_ff = SIZES[size]
    raw = exchange.run_config("350m", codec, islands, rounds).to_dict()
    raw["model"].update(vocab_size=vocab, d_model=d_model, n_layers=n_layers, d_ff=d_ff, n_heads=d_model // 64,
                        n_kv_heads=KV_HEADS.get(size, 0))
    return config_from_dict(raw)


def connect(address: str) -> CoordinatorClient:
    return CoordinatorClient(address, connect_timeout_s=600)


class ShardedIsland(Island):
    """exchange.Island, joined to a coordinator of several shards through a ShardedClient."""

    def __init__(self, leader: str, cfg: RunConfig, pg: dict[str, torch.Tensor] | None):
        super().__init__(leader, cfg, pg, client=ShardedClient(connect(leader), connect))

    def counters(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) of this island's connection to each shard, in shard order."""
        return [(c.bytes_sent, c.bytes_received) for c in self.client.clients]


def start_shards(procs: list, cfg: RunConfig, count: int, workdir: Path) -> list[str]:
    """Starts the K shard processes as a launcher would (each with its index, every shard's address and the secret
    they share), appending each to procs as it starts (the caller stops them); returns their addresses."""
    (workdir / "run.toml").write_text(cfg.to_toml())
    addresses = [f"127.0.0.1:{p}" for p in shard_ports("127.0.0.1", 0, count)]
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # spawn() hands this process's environment on
    for i, address in enumerate(addresses):
        proc, port = spawn(["-m", "coordinator", "serve", "--config", str(workdir / "run.toml"), "--host", "127.0.0.1",
                            "--port", address.rsplit(":", 1)[1], "--shard", str(i), "--shards", str(count),
                            "--shard-addresses", ",".join(addresses), "--log-level", "warning", "--linger", "0",
                            "--http-port", "-1"], workdir, f"shard-{i}")
        procs.append(proc)
        if f"127.0.0.1:{port}" != address:
            raise RuntimeError(f"shard {i} serves port {port}, not the {address} it was given")
    return addresses


def measure(cfg: RunConfig, count: int, islands: int, repeat: int, workdir: Path) -> dict:
    procs: list = []
    members: list[ShardedIsland] = []
    try:
        addresses = start_shards(procs, cfg, count, workdir)
        pids = [p.pid for p in procs]
        at_start = [(rss_now(pid), peak_rss(pid)) for pid in pids]
        first = ShardedIsland(addresses[0], cfg, None)
        members.append(first)
        members += [ShardedIsland(addresses[0], cfg, first.pg) for _ in range(islands - 1)]
        assert len(first.client.clients) == count, f"the leader named {len(first.client.clients)} shards, not {count}"
        seconds, mine_cpu, shard_cpu, sent, received = [], [], [], [], []
        for round_ in range(repeat + 1):
            before = [m.counters() for m in members]
            cpu_before, mine = [cpu_seconds(pid) for pid in pids], cpu_seconds()
            s = timed(members, lambda island, r=round_: island.exchange(r))
            cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu_before)]
            mine = cpu_seconds() - mine
            after = [m.counters() for m in members]
            if round_:  # round 0 warms up: codecs' JIT, connections, first allocations
                seconds.append(s)
                mine_cpu.append(mine)
                shard_cpu.append(cpu)
                # What island m sent shard s (its pushes) and received from it (its pulls), summed over islands.
                sent.append([sum(a[s][0] - b[s][0] for a, b in zip(after, before)) for s in range(count)])
                received.append([sum(a[s][1] - b[s][1] for a, b in zip(after, before)) for s in range(count)])
        checksums = {m.checksum for m in members}
        assert len(checksums) == 1, f"islands ended on different parameters: {sorted(checksums)}"
        (checksum,) = checksums
        assert checksum.count("+") == count - 1, f"a joined checksum of {checksum.count('+') + 1} parts for {count} shards"
        peaks = [peak_rss(pid) for pid in pids]
        params = first.manifest.total_numel()
        owned = ([sum(first.manifest.numel(n) for n in first.client.map.names(s)) for s in range(count)]
                 if first.client.map is not None else [params])
        model = 4 * params
        per_shard = [{
            "shard": s, "parameters": owned[s], "peak_rss": peaks[s], "peak_rss_x": peaks[s] / model,
            "rss_after_start": at_start[s][0], "rss_after_start_x": at_start[s][0] / model,
            "peak_rss_after_start": at_start[s][1], "peak_rss_after_start_x": at_start[s][1] / model,
            "cpu_s": statistics.median(c[s] for c in shard_cpu),
            "bytes_up": statistics.median(b[s] for b in sent), "bytes_down": statistics.median(b[s] for b in received),
        } for s in range(count)]
        return {
            "parameters": params, "model_fp32_bytes": model, "shards": count, "islands": islands,
            "exchange_s": statistics.median(seconds), "exchange_all_s": seconds, "islands_cpu_s": statistics.median(mine_cpu),
            "per_shard": per_shard, "checksum": checksum,
            **{f"{k}_{how}": f([p[k] for p in per_shard]) for k in ("peak_rss", "rss_after_start", "peak_rss_after_start", "cpu_s",
                                                                   "bytes_up", "bytes_down")
               for how, f in (("max", max), ("sum", sum))},
            **{f"{k}_{how}_x": f([p[k] for p in per_shard]) / model for k in ("peak_rss", "rss_after_start", "peak_rss_after_start")
               for how, f in (("max", max), ("sum", sum))},
        }
    finally:
        for m in members:
            m.client.close()
        for p in procs:
            stop(p)


def one(size: str, codec: str, count: int, islands: int, repeat: int) -> dict:
    cfg = run_config(size, codec, islands, repeat + 2)  # the run never finishes under the islands: we stop it
    tmp = Path(tempfile.mkdtemp(prefix="diloco-shards-"))
    try:
        with PeakRss() as islands_rss:  # this process: the islands' threads, their pseudo-gradient and pulled copies
            row = measure(cfg, count, islands, repeat, tmp)
    except BaseException:
        print(f"{PROG}: {size} {codec} K={count} x{islands} failed; logs kept in {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp)
    if islands_rss.peak_bytes is not None:
        row["islands_peak_rss"] = islands_rss.base_bytes + islands_rss.peak_bytes
        row["host_peak_rss"] = row["peak_rss_sum"] + row["islands_peak_rss"]  # what the machine held, at most
    return {"size": size, "codec": codec, **row}


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="125m,750m", help=f"model sizes, from {','.join(SIZES)} (default 125m,750m)")
    parser.add_argument("--shards", default="1,2,4", help="numbers of coordinator shards K (default 1,2,4)")
    parser.add_argument("--islands", default="1,4", help="numbers of islands (default 1,4)")
    parser.add_argument("--codec", default="fp32", help="uplink codec (the downlink uses the same; default fp32)")
    parser.add_argument("--repeat", type=int, default=2, help="measured exchanges per point, after one warm-up (default 2)")
    parser.add_argument("--out", metavar="PATH", help="also write every figure here as JSON")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    if bad := [s for s in sizes if s not in SIZES]:
        fail(PROG, f"--sizes: unknown size {bad[0]!r}; choose from {', '.join(SIZES)}")
    counts = {}
    for flag in ("shards", "islands"):
        try:
            counts[flag] = [int(n) for n in getattr(args, flag).split(",")]
        except ValueError:
            fail(PROG, f"--{flag}: expected numbers such as 1,2,4, got {getattr(args, flag)!r}")
        if any(n < 1 for n in counts[flag]):
            fail(PROG, f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.repeat < 1:
        fail(PROG, f"--repeat must be at least 1, got {args.repeat}")
    try:
        uplink_codec(load_config(None, [f"wire.codec={args.codec}"]).wire)
    except (ConfigError, ValueError) as e:  # a codec there is not
        fail(PROG, f"--codec: {e}")
    print(f"{PROG}: K coordinator shards, one exchange; {os.cpu_count()} cores, loopback, median of {args.repeat} after a "
          f"warm-up; memory in MiB (x the fp32 model), bytes per exchange summed over islands", flush=True)
    print("| parameters | codec | islands | shards | exchange | peak RSS per shard | max / sum (x model) | RSS after start, "
          "max / sum | CPU s per shard | MB to / from each shard | islands' process |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for size in sizes:
        for k in counts["shards"]:
            for n in counts["islands"]:
                r = one(size, args.codec, k, n, args.repeat)
                release_memory()  # the next point's islands start from what this one freed
                rows.append(r)
                shards = r["per_shard"]
                peaks = ", ".join(mib(p["peak_rss"]) for p in shards)
                cpu = ", ".join(f"{p['cpu_s']:.2f}" for p in shards)
                traffic = ", ".join(f"{p['bytes_up'] / 1e6:.1f} / {p['bytes_down'] / 1e6:.1f}" for p in shards)
                print(f"| {r['parameters'] / 1e6:.1f}M | {args.codec} | {n} | {k} | {r['exchange_s']:.3f} s | {peaks} | "
                      f"{mib(r['peak_rss_max'])} ({r['peak_rss_max_x']:.2f}x) / {mib(r['peak_rss_sum'])} ({r['peak_rss_sum_x']:.2f}x) | "
                      f"{mib(r['rss_after_start_max'])} ({r['rss_after_start_max_x']:.2f}x) / "
                      f"{mib(r['rss_after_start_sum'])} ({r['rss_after_start_sum_x']:.2f}x) | {cpu} | {traffic} | "
                      f"{mib(r['islands_peak_rss']) if 'islands_peak_rss' in r else '?'} |", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
