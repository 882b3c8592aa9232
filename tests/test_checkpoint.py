"""Checkpoint store on a local path and on S3 (a real S3 API: moto's server on 127.0.0.1, through s3fs)."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
import torch

from conftest import claim, ended, one_island_config, random_like, trained_from, wait_for_round
from coordinator.server import start_coordinator
from diloco.checkpoint import CheckpointError, CheckpointStore
from diloco.wire.codec import Fp32Codec
from diloco.v1 import diloco_pb2 as pb
from diloco.v1 import diloco_pb2_grpc as pb_grpc
from diloco.wire.messages import PROTOCOL_VERSION, tensor_chunks


@pytest.fixture(params=[pytest.param("local", marks=pytest.mark.unit),
                        pytest.param("s3", marks=pytest.mark.integration)])  # s3: a moto server on 127.0.0.1
def base_url(request, tmp_path):
    return str(tmp_path / "ckpt") if request.param == "local" else request.getfixturevalue("s3")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"params": {"w": torch.randn(64, 8, generator=g)}, "step": seed, "nested": {"rng": [1, 2, 3]}}


def test_save_load_prune_and_metadata(base_url):
    store = CheckpointStore(f"{base_url}/run", keep_last=2)
    assert store.latest() is None and store.load_meta() is None
    for step in range(4):
        store.save(step, _state(step), {"round": step})
    assert store.steps() == [2, 3]  # keep_last=2
    tensors, meta = store.load()
    assert meta == {"round": 3} and torch.equal(tensors["params"]["w"], _state(3)["params"]["w"])
    assert tensors["nested"] == {"rng": [1, 2, 3]}
    assert store.load(2)[1] == {"round": 2} and store.load_meta() == {"round": 3}


def test_torn_checkpoint_is_never_loaded(base_url):
    store = CheckpointStore(f"{base_url}/run", keep_last=5)
    store.save(1, _state(1), {"round": 1})
    # A crash after the data, before the commit marker: step 2 exists but is not committed.
    store.fs.makedirs(f"{store.root}/step-0000000002", exist_ok=True)
    with store.fs.open(f"{store.root}/step-0000000002/state.pt", "wb") as f:
        f.write(b"half a checkpoint")
    assert store.steps() == [1] and store.latest() == 1
    assert store.load()[1] == {"round": 1}
    with pytest.raises(CheckpointError, match="not committed"):
        store.load(2)


def test_a_save_killed_while_writing_its_commit_marker_leaves_the_step_uncommitted(base_url, monkeypatch):
    """The marker is written under another name and then moved: a process killed in between never leaves a marker
    that exists but is not whole. Before, a coordinator SIGKILLed as its marker appeared (empty) failed to resume
    from it: 'Expecting value: line 1 column 1 (char 0)'."""
    store = CheckpointStore(f"{base_url}/run", keep_last=5)
    store.save(1, _state(1), {"round": 1})
    real_mv = store.fs.mv

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while committing")  # the process ends here: nothing after runs

    monkeypatch.setattr(store.fs, "mv", killed)
    with pytest.raises(KeyboardInterrupt):
        store.save(2, _state(2), {"round": 2})
    monkeypatch.setattr(store.fs, "mv", real_mv)
    assert store.steps() == [1] and store.load()[1] == {"round": 1}
    with pytest.raises(CheckpointError, match="not committed"):
        store.load(2)
    # A marker found not whole (written by an older release) is a torn step too, never a crash of the reader.
    store.save(3, _state(3), {"round": 3})
    with store.fs.open(f"{store.root}/step-0000000003/COMMITTED", "w") as f:
        f.write("")
    assert store.load()[1] == {"round": 1}
    with pytest.raises(CheckpointError, match="not committed"):
        store.load(3)


def test_damaged_committed_checkpoint_falls_back_to_the_one_before(base_url, caplog):
    store = CheckpointStore(f"{base_url}/run", keep_last=5)
    store.save(1, _state(1), {"round": 1})
    store.save(2, _state(2), {"round": 2})
    with store.fs.open(f"{store.root}/step-0000000002/state.pt", "wb") as f:
        f.write(b"bit rot")
    with caplog.at_level(logging.WARNING):
        tensors, meta = store.load()
    assert meta == {"round": 1} and "does not match its commit marker" in caplog.text
    with pytest.raises(CheckpointError, match="corrupt"):
        store.load(2)


def test_resaving_a_step_replaces_it(base_url):
    store = CheckpointStore(f"{base_url}/run")
    store.save(3, _state(1), {"v": 1})
    store.save(3, _state(2), {"v": 2})
    assert store.steps() == [3] and store.load()[1] == {"v": 2}


@pytest.mark.unit
def test_unusable_location_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        CheckpointStore(str(tmp_path / "empty")).load()
    with pytest.raises(CheckpointError, match="checkpoint location is needed"):
        CheckpointStore("")


@pytest.mark.integration
def test_coordinator_resumes_from_s3(s3, tmp_path):
    cfg = one_island_config("rounds.rounds=4", f"checkpoint.url='{s3}/coordinator'", "checkpoint.every_rounds=1")
    first = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / "spool1"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=5).island_id
            for round_ in range(2):
                pg = random_like(first.state.manifest.shapes, seed=round_)
                header = pb.PushHeader(island_id=island, round=round_, codec="fp32", **claim(cfg), global_checksum=trained_from(first))
                messages = [pb.PushMessage(header=header)]
                messages += [pb.PushMessage(chunk=c) for c in tensor_chunks(pg, Fp32Codec(), cfg.wire.chunk_bytes)]
                stub.PushPseudoGradient(ended(messages), timeout=10)
                wait_for_round(first, round_)
        store = CheckpointStore(cfg.checkpoint.url)
        deadline = time.monotonic() + 10
        while store.latest() != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.latest() == 2
        params = {n: t.clone() for n, t in first.state.fragments[0].outer.params.items()}
        history = list(first.state.fragments[0].guard.history)
    finally:
        first.stop(0.5)
    second = start_coordinator(cfg, "127.0.0.1", 0, spool_dir=str(tmp_path / "spool2"), resume=True)
    try:
        assert second.state.round == 2 and list(second.state.islands) == [island]
        assert all(torch.equal(second.state.fragments[0].outer.params[n], t) for n, t in params.items())
        # The norm guard judges on from its history: else the first round back waited for robust.first_quorum and
        # judged without a reference (found in the issue-42 team run).
        assert len(history) == 2 and second.state.fragments[0].guard.history == history
    finally:
        second.stop(0.5)
