"""Codec benchmark: throughput on one core, and bytes on the wire for a real pseudo-gradient.

1. Throughput. Each codec encodes and decodes a Gaussian fp32 tensor of 1M, 16M
   and 128M elements the way the wire does it (chunks of at most
   wire.chunk_bytes of payload), on one thread, against a straightforward torch
   implementation of the same format (the reference functions below, which
   produce the same bytes). Figures are MB/s of fp32 input (10^6 bytes),
   best of --repeat runs; "enc+dec" is the rate of encoding then decoding.
2. Wire bytes. A real pseudo-gradient (theta_global - theta_local after H=50
   AdamW steps of the byte-level model on tinyshakespeare, after two earlier
   rounds) is pushed through `diloco.wire.messages.tensor_chunks` with each codec, and
   the protobuf messages are measured, as the coordinator counts them.

Run from the repository root:  python -m benchmarks.codecs
(about 3 minutes on one core; --sizes 1 for a quick look).
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from diloco.wire.codec import get_codec
from diloco.config import load_config
from diloco.data.sources import train_stream
from diloco.inner import build_inner_optimizer, inner_lr, train_step
from diloco.models.llama import Transformer
from diloco.outer import pseudo_gradient
from diloco.params import fp32_copy
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import payload_digest, tensor_chunks
from diloco.wire.tensor_codec import e3m0_decode, e3m0_encode, from_payload, to_payload

REPO_ROOT = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 1 << 20
BLOCK = 256


# --- straightforward torch references (same formats as diloco.wire.codec) ---------------------


def ref_int8_encode(x: torch.Tensor) -> bytes:
    n = x.numel()
    pad = (-n) % BLOCK
    v = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)
    absmax = v.abs().amax(1, keepdim=True)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    q = torch.round(v * inv).to(torch.int8).view(-1)[:n]
    return (absmax / 127.0).view(-1).numpy().tobytes() + q.numpy().tobytes()


def ref_int8_decode(payload: bytes, n: int) -> torch.Tensor:
    blocks = -(-n // BLOCK)
    scales = torch.from_numpy(np.frombuffer(payload, np.float32, count=blocks).copy())
    q = torch.from_numpy(np.frombuffer(payload, np.int8, offset=4 * blocks).copy())
    pad = (-n) % BLOCK
    return (torch.nn.functional.pad(q.to(torch.float32), (0, pad)).view(-1, BLOCK) * scales[:, None]).view(-1)[:n]


REFERENCES: dict[str, tuple[Callable, Callable]] = {
    "int8": (ref_int8_encode, ref_int8_decode),
    # The torch ops a GPU island will encode with (diloco/wire/tensor_codec.py): the kernels' bytes exactly.
    "e3m0": (lambda x: to_payload(*e3m0_encode(x, BLOCK)), lambda payload, n: e3m0_decode(*from_payload(payload, n, BLOCK), n, BLOCK)),
}


# --- throughput --------------------------------------------------------------------------


def chunked(encode: Callable, decode_into: Callable, x: torch.Tensor, step: int, out: torch.Tensor) -> tuple[float, float]:
    """Seconds to encode x chunk by chunk, and to decode the chunks back into out, a tensor
    that already exists (as the global parameters do when `diloco.wire.messages.apply_chunks`
    decodes each chunk straight into its range)."""
    started = time.perf_counter()
    payloads = [encode(x[s : s + step]) for s in range(0, x.numel(), step)]
    encoded = time.perf_counter()
    for i, payload in enumerate(payloads):
        decode_into(payload, out[i * step : (i + 1) * step])
    decoded = time.perf_counter()
    return encoded - started, decoded - encoded


def throughput(names: list[str], sizes: list[int], repeat: int) -> list[str]:
    rows = [
        "| codec | elements | ours enc MB/s | ours dec MB/s | ours enc+dec MB/s | torch ref enc+dec MB/s | speed-up | bytes/element |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        out = torch.zeros_like(x)  # touched once, outside the timing, like long-lived parameters
        mb = 4 * n / 1e6
        for name in names:
            codec = get_codec(name)
            step = codec.max_elements(CHUNK_BYTES)
            chunked(codec.encode, codec.decode_into, x[: min(n, 4 * step)], step, out)  # warm up (numba JIT, allocator)
            enc, dec = map(min, zip(*(chunked(codec.encode, codec.decode_into, x, step, out) for _ in range(repeat))))
            ref_text, speedup = "—", "—"
            if name in REFERENCES:
                ref_enc, ref_dec = REFERENCES[name]
                # The reference really is the same codec: same format, and the same bytes but for
                # the odd element where torch's vectorised 127/absmax differs from IEEE division by
                # an ulp and a value on a rounding boundary lands one step away.
                probe = x[:step]
                ours, theirs = np.frombuffer(codec.encode(probe), np.uint8), np.frombuffer(ref_enc(probe), np.uint8)
                assert ours.size == theirs.size and np.count_nonzero(ours != theirs) <= ours.size // 10000, name
                assert torch.equal(ref_dec(codec.encode(probe), probe.numel()), codec.decode(codec.encode(probe), probe.numel()))
                ref_into = lambda payload, out: out.copy_(ref_dec(payload, out.numel()))  # noqa: E731
                r_enc, r_dec = map(min, zip(*(chunked(ref_enc, ref_into, x, step, out) for _ in range(repeat))))
                ref_text = f"{mb / (r_enc + r_dec):,.0f}"
                speedup = f"{(r_enc + r_dec) / (enc + dec):.1f}x"
            size = len(codec.encode(x[:step])) / min(step, n)  # entropy-coded top-k: what this input took
            rows.append(
                f"| {name} | {n / 2**20:.0f}M | {mb / enc:,.0f} | {mb / dec:,.0f} | {mb / (enc + dec):,.0f} | {ref_text} | {speedup} | {size:.3f} |"
            )
        print(rows[-1], file=sys.stderr, flush=True)  # progress; the table follows on stdout
    return rows


def digest_rates(n: int, repeat: int) -> str:
    """What checking a chunk costs: the chunk digest (diloco.wire.messages.payload_digest, XXH3-64) against the CRC-32 it
    replaced (protocol 8), over n fp32 elements in CHUNK_BYTES chunks."""
    data = memoryview(torch.randn(n).numpy()).cast("B")
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]

    def rate(digest: Callable) -> float:
        best = min(_timed(lambda: [digest(c) for c in chunks]) for _ in range(repeat))
        return len(data) / best / 1e6

    return f"Chunk digest over {n / 2**20:.0f}Mi fp32 elements: XXH3-64 {rate(payload_digest):,.0f} MB/s, CRC-32 {rate(zlib.crc32):,.0f} MB/s"


def _timed(work: Callable) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


# --- bytes on the wire for a real pseudo-gradient ------------------------------------------


def real_pseudo_gradient(data: Path, rounds: int = 3, h: int = 50) -> dict[str, torch.Tensor]:
    cfg = load_config(None, [
        "data.source='text'", f"data.path='{data}'", "model.vocab_size=256", "data.seq_len=128",
        "inner.batch_size=8", f"inner.steps_per_round={h}", "inner.warmup_steps=50", "inner.lr=3e-3",
    ])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = build_inner_optimizer(model, cfg.inner)
    stream = train_stream(cfg.data, 0, 0, 4)
    for step in range((rounds - 1) * h):
        train_step(model, optimizer, stream.next_batch(8), inner_lr(step, 400, cfg.inner), 1.0)
    start = fp32_copy(model)
    for step in range((rounds - 1) * h, rounds * h):
        train_step(model, optimizer, stream.next_batch(8), inner_lr(step, 400, cfg.inner), 1.0)
    return pseudo_gradient(start, dict(model.named_parameters()))


def wire_bytes(pg: dict[str, torch.Tensor], names: list[str]) -> list[str]:
    numel = sum(t.numel() for t in pg.values())
    header = pb.PushMessage(header=pb.PushHeader(island_id="island-0", round=2, tokens=51200, codec="fp32")).ByteSize()
    rows = [
        f"Pseudo-gradient of {numel / 1e6:.2f}M parameters (fp32 tensor data: {4 * numel / 1e6:.2f} MB).",
        "",
        "| codec | bytes on the wire | smaller than fp32 | relative L2 error of the decoded pseudo-gradient |",
        "|---|---|---|---|",
    ]
    baseline = None
    for name in names:
        base, _, density = name.partition("@d")  # "topk+zstd@d0.15": top-k at 15% density
        codec = get_codec(base, density=float(density)) if density else get_codec(base)
        total = header
        err_num = err_den = 0.0
        for chunk in tensor_chunks(pg, codec, CHUNK_BYTES):
            total += pb.PushMessage(chunk=chunk).ByteSize()
            original = pg[chunk.name].reshape(-1)[chunk.offset : chunk.offset + chunk.numel]
            err_num += float((codec.decode(chunk.payload, chunk.numel) - original).square().sum())
            err_den += float(original.square().sum())
        baseline = baseline or total
        rows.append(f"| {name} | {total:,} | {baseline / total:.1f}x | {np.sqrt(err_num / err_den):.4f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(prog="codecs", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,16,128", help="tensor sizes in Mi elements (default 1,16,128)")
    p.add_argument("--codecs", default="int8,e3m0,topk,bf16,fp32", help="codecs for the throughput table")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is kept (default 3)")
    p.add_argument("--data", default="../shared/data/tinyshakespeare.txt", help="text for the real pseudo-gradient")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-wire", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not args.skip_throughput:
        print("Throughput, one core (MB/s of fp32 input, best of %d):\n" % args.repeat, flush=True)
        rows = throughput(args.codecs.split(","), [int(s) << 20 for s in args.sizes.split(",")], args.repeat)
        print("\n".join(rows), flush=True)
        print("\n" + digest_rates(max(int(s) for s in args.sizes.split(",")) << 20, args.repeat), flush=True)
    if not args.skip_wire:
        data = Path(args.data)
        data = data if data.is_absolute() else (REPO_ROOT / data).resolve()
        pg = real_pseudo_gradient(data)
        names = ["fp32", "fp32+zstd", "bf16", "bf16+zstd", "int8", "int8+zstd", "e3m0", "e3m0+zstd", "topk", "topk+zstd",
                 "topk@d0.05", "topk+zstd@d0.05", "topk@d0.12", "topk+zstd@d0.12", "topk@d0.15", "topk+zstd@d0.15"]
        print("\nBytes on the wire for one island's push:\n")
        print("\n".join(wire_bytes(pg, names)), flush=True)


if __name__ == "__main__":
    main()
