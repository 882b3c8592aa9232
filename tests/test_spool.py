"""Spools (coordinator/spool.py): pushes wait in the shared memory pool, then on disk, and read back in order."""

from __future__ import annotations

import random

import pytest

from diloco.wire.refusal import Refused
from coordinator.spool import BLOCK_PAYLOAD, OWNER_FILE, SpoolCorrupt, SpoolDir, Spools, remove_orphaned_spool_dirs
from diloco.wire.refusal import Reason
from diloco.wire.messages import payload_digest

pytestmark = pytest.mark.unit


def _records(seed: int, n: int, size: int) -> list[tuple[str, int, int, bytes]]:
    rng = random.Random(seed)
    return [(f"blocks.{k}.w", 1000 * k, size // 4, rng.randbytes(size)) for k in range(n)]


def _write(spool, records) -> None:
    for name, offset, numel, payload in records:
        spool.write(name, offset, numel, payload_digest(payload), payload)


def _read(spool) -> list[tuple[str, int, int, bytes]]:
    return [(c.name, c.offset, c.numel, bytes(c.payload)) for c in spool.read()]


def test_pushes_fill_the_memory_pool_then_go_to_disk_and_read_back_in_order(tmp_path):
    spools = Spools(tmp_path, max_bytes=1 << 30, memory_bytes=2 * BLOCK_PAYLOAD)
    records = _records(0, 12, 3 << 20)  # two records a block, two blocks: 4 in memory, 8 on disk
    first, second = spools.open(1 << 40), spools.open(1 << 40)
    _write(first, records[:5])
    assert first.path is not None and spools.pool.allocated == 2  # the fifth found the pool spent: the file began
    _write(first, records[5:7])
    _write(first, records[7:8])
    _write(second, records[8:])  # the pool is spent: all on disk
    assert _read(first) == records[:8] and _read(second) == records[8:]
    assert spools.used == sum(s.bytes for s in (first, second)) > 12 * (3 << 20)
    first.discard(), second.discard()
    assert spools.used == 0 and spools.pool.free_blocks == 2 and not first.path.exists() and not second.path.exists()
    # The blocks are reused, not allocated again: the next spool is in memory alone.
    third = spools.open(1 << 40)
    _write(third, records[:4])
    assert third.path is None and spools.pool.allocated == 2
    assert _read(third) == records[:4]
    third.discard()
    assert spools.used == 0 and spools.pool.free_blocks == 2


def test_a_pool_of_one_models_bytes_holds_a_whole_push_of_that_model_in_full_size_chunks(tmp_path):
    """Blocks fit a whole number of the largest records with their headers: before, 8 MiB blocks held seven 1 MiB
    records and an eighth of every model-sized push went to disk."""
    from diloco.wire.codec import get_codec
    from diloco.wire.messages import chunk_spans

    chunk_bytes, fp32 = 1 << 20, get_codec("fp32")
    shapes = {f"blocks.{k}.mlp.w_down.weight": 3 * (1 << 18) + 7 * k for k in range(11)} | {"norm.weight": 768}
    spools = Spools(tmp_path, max_bytes=1 << 30, memory_bytes=4 * sum(shapes.values()), chunk_bytes=chunk_bytes)
    spool = spools.open(sum(shapes.values()))
    records = [(name, lo, hi - lo, bytes(4 * (hi - lo))) for name, numel in shapes.items()
               for lo, hi in chunk_spans(numel, fp32, chunk_bytes)]
    _write(spool, records)
    assert spool.path is None, "part of the push went to disk"
    assert _read(spool) == records and spools.used == spool.bytes
    blocks = -(-spool.bytes // spools.pool.block_bytes)
    spool.discard()
    assert spools.used == 0 and spools.pool.free_blocks == spools.pool.allocated == blocks
    for chunk_bytes in (1 << 10, 1 << 20, 3 << 20):  # every size the config takes: a block holds a whole number of records
        pool = Spools(tmp_path, 1 << 30, 64 << 20, chunk_bytes).pool
        assert pool.block_bytes // (chunk_bytes + 64) * chunk_bytes >= min(BLOCK_PAYLOAD, chunk_bytes)
        assert chunk_bytes != 1 << 20 or pool.block_bytes <= 1.001 * BLOCK_PAYLOAD  # the default: 8 records, 2 KiB over


def test_a_spool_in_memory_holds_records_of_every_size_and_refuses_what_its_fragment_cannot_hold(tmp_path):
    spools = Spools(tmp_path, max_bytes=1 << 30, memory_bytes=4 * BLOCK_PAYLOAD)
    rng = random.Random(1)
    records = [(rng.choice(["a", "é" * 40, "embed.weight"]), rng.randrange(1 << 40), rng.randrange(1, 1 << 20), rng.randbytes(size))
               for size in (0, 1, 4, 4097, 1 << 20, (3 << 20) + 5, 17, 0)]
    spool = spools.open(sum(r[2] for r in records))
    _write(spool, records)
    assert spool.path is None and _read(spool) == records
    with pytest.raises(Refused) as err:  # one element more than the fragment has
        spool.write("a", 0, 1, payload_digest(b"\0" * 4), b"\0" * 4)
    assert err.value.refusal.reason == Reason.BAD_CHUNK
    spool.discard()


def test_the_spool_bound_counts_memory_and_disk_together(tmp_path):
    spools = Spools(tmp_path, max_bytes=3 * (1 << 20), memory_bytes=BLOCK_PAYLOAD)
    spool = spools.open(1 << 40)
    _write(spool, _records(2, 2, 1 << 20))  # in memory
    with pytest.raises(Refused) as err:
        _write(spool, _records(3, 1, 1 << 20))
    assert err.value.refusal.reason == Reason.SPOOL_FULL
    spool.discard()
    assert spools.used == 0


def test_what_went_to_disk_is_verified_as_it_is_read_back(tmp_path):
    spools = Spools(tmp_path, max_bytes=1 << 30, memory_bytes=BLOCK_PAYLOAD)
    records = _records(4, 4, 3 << 20)  # two in memory, two on disk
    spool = spools.open(1 << 40)
    _write(spool, records)
    spool.close()
    data = bytearray(spool.path.read_bytes())
    data[-1] ^= 0xFF
    spool.path.write_bytes(bytes(data))
    with pytest.raises(SpoolCorrupt, match="blocks.3.w@3000"):
        _read(spool)
    spool.discard()


def test_a_push_cut_off_mid_stream_gives_its_memory_back_and_the_island_pushes_whole_again(tmp_path):
    """The island vanishes half-way through its push: nothing of it is kept (spool bytes 0, every pool block free
    again), the round does not close on it, and its push sent again whole is folded as if nothing had happened."""
    from conftest import claim, random_like, trained_from
    from kit import make_state, push

    from diloco.v1 import diloco_pb2 as pb
    from diloco.wire.messages import tensor_chunks, uplink_codec

    state = make_state(tmp_path, "limits.spool_memory_models=1000", "rounds.deadline_s=1000")
    a, b = state.join("a").island_id, state.join("b").island_id
    pg = random_like(state.manifest.shapes, 3)
    codec = uplink_codec(state.cfg.wire)
    chunks = list(tensor_chunks(pg, codec, state.cfg.wire.chunk_bytes))

    def cut_off():
        yield from chunks[: len(chunks) // 2]
        raise ConnectionResetError("the island's connection dropped")

    header = pb.PushHeader(island_id=b, round=0, train_loss=2.0, codec=codec.name, **claim(state.cfg),
                           global_checksum=trained_from(state))
    spools = state.fragments[0].ctx.spools
    with pytest.raises(ConnectionResetError):
        state.receive(header, cut_off())
    assert spools.used == 0 and spools.pool.allocated >= 1 and spools.pool.free_blocks == spools.pool.allocated
    push(state, a, random_like(state.manifest.shapes, 1))
    assert state.fragments[0].step(poll_s=0) is None, "the round closed on a push that broke off"
    assert push(state, b, pg).contribution_complete
    closed = state.fragments[0].step(poll_s=0)
    assert closed is not None and list(closed.summary.islands) == [a, b]
    assert closed.summary.elements_folded == closed.summary.elements_expected
    assert spools.used == 0


def test_only_spool_directories_nobody_holds_are_removed(tmp_path, monkeypatch):
    """A coordinator's own directory stays locked while it lives (another open file's lock conflicts with it, in
    this process too); a killed one's lock is gone with it; one from an older release has no owner file."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TMPDIR
    mine = SpoolDir.make()
    orphan, older, other = tmp_path / "diloco-spool-orphan", tmp_path / "diloco-spool-older", tmp_path / "elsewhere"
    for folder in (orphan, older, other):
        folder.mkdir()
        (folder / "push-1.spool").write_bytes(bytes(10))
    for folder in (orphan, other):
        (folder / OWNER_FILE).write_bytes(b"")
    assert remove_orphaned_spool_dirs(tmp_path) == [orphan]
    assert mine.path.is_dir() and older.is_dir() and other.is_dir() and not orphan.exists()
    second = SpoolDir.make()  # sweeps too, and leaves the first alone
    assert mine.path.is_dir() and second.path != mine.path
    mine.remove()
    second.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diloco-spool-older", "elsewhere"]


def test_coordinators_starting_together_remove_each_left_directory_once(tmp_path):
    """K shards launched on one machine sweep at the same moment: each left directory goes once, and a sweep that
    finds one another just removed goes on rather than failing its coordinator's start."""
    from concurrent.futures import ThreadPoolExecutor

    left = []
    for i in range(200):
        folder = tmp_path / f"diloco-spool-{i:03d}"
        folder.mkdir()
        (folder / OWNER_FILE).write_bytes(b"")
        (folder / "push-1.spool").write_bytes(bytes(10))
        left.append(folder)
    with ThreadPoolExecutor(4) as pool:
        sweeps = [pool.submit(remove_orphaned_spool_dirs, tmp_path) for _ in range(4)]
        removed = [path for sweep in sweeps for path in sweep.result()]
    assert sorted(removed) == left and list(tmp_path.iterdir()) == []
