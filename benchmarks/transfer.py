"""Helpers of benchmarks/exchange.py: servers in processes of their own, timed threads, and the bare gRPC transfer.

The bare transfer is what an exchange is compared with: a gRPC server that only
counts what it is sent and streams back pre-built payloads, as protocol messages
(parsed and serialized by gRPC, as the coordinator's are) and as raw bytes.
Run as a script, this file is that server (`transfer.py --bare-server PORT_FILE`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from diloco.v1 import diloco_pb2 as pb
from islands.sim.wan import LinkSpec, WanLink

REPO_ROOT = Path(__file__).resolve().parent.parent

BARE_SERVICE = "diloco.bench.Bare"


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process, every thread of it: this one when pid is None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the command's name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def timed_cpu(workers: list, work, pid: int) -> tuple[float, float, float]:
    """timed(), the CPU seconds this process (the islands) and process pid (the server) spent meanwhile, and the
    server's part of them: on one machine an exchange can take no less than their sum over the number of cores,
    however well its parts overlap."""
    mine, server = cpu_seconds(), cpu_seconds(pid)
    seconds = timed(workers, work)
    server = cpu_seconds(pid) - server
    return seconds, cpu_seconds() - mine + server, server


def release_memory() -> None:
    """Hands what this process freed back to the system. The islands' threads free a model's worth of 1 MiB buffers
    a point in glibc's per-thread arenas, which keep them: a grid of 125M points in one process grew past 21 GB and
    was killed (with 4 e3m0 islands, after the fp32 and int8 points)."""
    gc.collect()
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


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
    proc, port = spawn(["-m", "benchmarks.transfer", "--bare-server"], workdir, "bare")
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

        messages, cpu, _ = zip(*[timed_cpu(channels, by_messages, proc.pid) for _ in range(repeat + 1)][1:])
        raw = [timed(channels, by_bytes) for _ in range(repeat + 1)][1:]
        return {"messages_s": statistics.median(messages), "raw_s": statistics.median(raw), "messages_all_s": list(messages),
                "raw_all_s": raw, "messages_cpu_s": statistics.median(cpu)}
    finally:
        for c in channels:
            c.close()
        for lk in links:
            lk.stop()
        stop(proc)




if __name__ == "__main__" and sys.argv[1:2] == ["--bare-server"]:
    bare_server(sys.argv[sys.argv.index("--port-file") + 1])
