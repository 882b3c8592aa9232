"""The coordinator's Prometheus metrics: read from its state, in the exposition format, matching the run."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import claim, one_island_config, tiny_config, trained_from, wait_for_round
from coordinator.metrics import CheckpointStats, coordinator_metrics
from diloco.wire.codec import Fp32Codec
from diloco.v1 import diloco_pb2 as pb
from diloco.wire.messages import PROTOCOL_VERSION, push_messages, tensor_chunks

pytestmark = pytest.mark.integration


def _samples(metrics) -> dict[tuple[str, tuple], float]:
    body, content_type = metrics()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_metrics_follow_the_run(make_coordinator, channel_to):
    cfg = tiny_config("rounds.rounds=3", "rounds.min_islands=2")
    coordinator = make_coordinator(cfg)
    stub = channel_to(coordinator)
    # Island i declares i + 1 ranks and claims a step on each: unequal tokens, told apart below.
    ids = [stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION, island_key=k, ranks=i + 1), timeout=10).island_id
           for i, k in enumerate("ab")]
    checkpoints = CheckpointStats()
    metrics = coordinator_metrics(coordinator.state, checkpoints)
    shapes = coordinator.state.manifest.shapes
    for round_ in range(2):
        for i, island in enumerate(ids):
            g = torch.Generator().manual_seed(10 * round_ + i)
            pg = {n: torch.randn(s, generator=g) * 1e-3 for n, s in shapes.items()}
            header = pb.PushHeader(island_id=island, round=round_, train_loss=2.0 + i, codec="fp32", **claim(cfg, 1, ranks=i + 1),
                                   global_checksum=trained_from(coordinator))
            stub.PushPseudoGradient(push_messages(header, tensor_chunks(pg, Fp32Codec(), 4096)), timeout=30)
        wait_for_round(coordinator, round_, timeout_s=60)
    stub.Heartbeat(pb.HeartbeatRequest(island_id=ids[0], utilization=0.9, tokens_per_s=1234.5, train_loss=2.5), timeout=10)
    with pytest.raises(grpc.RpcError):  # refused: counted by its reason
        stub.Heartbeat(pb.HeartbeatRequest(island_id="nobody"), timeout=10)
    checkpoints.record(0.25, ok=True)
    checkpoints.record(0.5, ok=False)

    s = _samples(metrics)
    assert s[("diloco_rounds_closed_total", (("fragment", "0"),))] == 2
    assert s[("diloco_round", (("fragment", "0"),))] == 2
    assert s[("diloco_islands", (("status", "live"),))] == 2
    summaries = coordinator.state.summaries
    for island in ids:
        up = sum(t.bytes_up for r in summaries for t in r.traffic if t.island_id == island)
        assert up > 0 and s[("diloco_island_bytes_up_total", (("island", island),))] == up
        assert s[("diloco_island_last_push_timestamp_seconds", (("island", island),))] > 0
    assert s[("diloco_island_tokens_total", (("island", ids[1]),))] == 2 * claim(cfg, 1, ranks=2)["tokens"]
    assert s[("diloco_island_train_loss", (("island", ids[1]),))] == 3.0
    assert s[("diloco_island_utilization", (("island", ids[0]),))] == 0.9
    assert s[("diloco_island_tokens_per_second", (("island", ids[0]),))] == 1234.5
    assert s[("diloco_refusals_total", (("reason", "NOT_A_MEMBER"),))] == 1
    assert s[("diloco_communication_factor", ())] > 0
    fold = sum(r.fold_s for r in summaries)
    assert fold > 0 and s[("diloco_round_phase_seconds_total", (("phase", "fold"),))] == pytest.approx(fold)
    assert s[("diloco_checkpoints_total", ())] == 1 and s[("diloco_checkpoint_failures_total", ())] == 1
    assert s[("diloco_last_checkpoint_seconds", ())] == 0.5
    # Every push done: no slot held, none waiting, the default bound (limits.push_slots).
    assert [s[("diloco_push_slots", (("kind", k),))] for k in ("held", "waiting", "bound")] == [0, 0, 32]
    again = _samples(metrics)  # a second scrape folds nothing twice
    assert again[("diloco_island_bytes_up_total", (("island", ids[0]),))] == s[("diloco_island_bytes_up_total", (("island", ids[0]),))]


def test_a_failing_checkpoint_is_counted_and_the_run_goes_on(make_coordinator, channel_to, tmp_path):
    target = tmp_path / "ckpt"
    cfg = one_island_config("rounds.rounds=3", f"checkpoint.url={target}", "checkpoint.every_rounds=1")
    coordinator = make_coordinator(cfg)
    shutil.rmtree(target, ignore_errors=True)
    target.write_text("a file where the checkpoints should go")  # every write under it fails from now on
    stub = channel_to(coordinator)
    island = stub.Join(pb.JoinRequest(protocol_version=PROTOCOL_VERSION), timeout=10).island_id
    zeros = {n: torch.zeros(s) for n, s in coordinator.state.manifest.shapes.items()}
    for round_ in range(3):
        header = pb.PushHeader(island_id=island, round=round_, codec="fp32", **claim(cfg), global_checksum=trained_from(coordinator))
        stub.PushPseudoGradient(push_messages(header, tensor_chunks(zeros, Fp32Codec(), 4096)), timeout=30)
        wait_for_round(coordinator, round_, timeout_s=60)
    assert coordinator.wait(60), "the round drivers stopped on a failed checkpoint"
    assert coordinator.checkpoints.failed == 3 and coordinator.checkpoints.written == 0
