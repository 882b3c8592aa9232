"""The GPU paths: bf16 autocast in one-rank islands, FSDP2 over NCCL with bf16 compute, GPU placement.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest tests/test_gpu.py`.
The multi-process runs are tests/fsdp_scenarios.py's `cuda` scenario, inside `unshare -rn` like
tests/test_fsdp_islands.py. The sharded run needs two GPUs: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import run_scenario, tiny_config
from islands.launch import LaunchError, LaunchOptions, gpu_placement

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- placement of replica groups on a node's GPUs (no GPU needed) ---------------------------------


@pytest.mark.unit
def test_each_replica_group_gets_its_own_gpus():
    opts = LaunchOptions(nproc_per_node=2, replica_groups=2, device="cuda")
    assert gpu_placement(opts, {}, 4) == ["0,1", "2,3"]
    assert gpu_placement(opts, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 4) == ["4,5", "6,7"]
    assert gpu_placement(LaunchOptions(nproc_per_node=1, replica_groups=3, device="auto"), {}, 3) == ["0", "1", "2"]
    assert gpu_placement(LaunchOptions(replica_groups=2, device="cpu"), {}, 8) is None
    assert gpu_placement(LaunchOptions(replica_groups=2, device="auto"), {}, 0) is None


@pytest.mark.unit
def test_too_few_gpus_for_the_groups_is_a_clear_error():
    with pytest.raises(LaunchError, match=r"needs 4 GPUs on this node, but 1 is visible"):
        gpu_placement(LaunchOptions(nproc_per_node=2, replica_groups=2, device="cuda"), {}, 1)
    with pytest.raises(LaunchError, match=r"needs 2 GPUs on this node, but 1 is visible"):
        gpu_placement(LaunchOptions(nproc_per_node=1, replica_groups=2, device="cuda"), {"CUDA_VISIBLE_DEVICES": "3"}, 1)


@pytest.mark.integration
def test_a_rank_beyond_the_visible_gpus_exits_with_a_one_line_error():
    visible = torch.cuda.device_count()
    out = subprocess.run(
        [sys.executable, "-m", "islands", "join", "--coordinator", "127.0.0.1:9", "--device", "cuda"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LOCAL_RANK": str(visible)},
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert f"LOCAL_RANK is {visible} but {visible} CUDA device(s) are visible" in out.stderr
    assert "Traceback" not in out.stderr


# --- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.integration
@needs_cuda
@pytest.mark.timeout(300)
def test_one_rank_island_on_cuda_ends_with_the_coordinators_parameters(tmp_path):
    result = run_scenario("fsdp_scenarios.py", "cuda", tmp_path, 260, "0", "1")
    assert result["notes"]["exit_codes"] == {"single": 0}
    assert result["final_round"] == 3
    assert all(r["elements_folded"] == r["elements_expected"] > 0 for r in result["rounds"])
    assert set(result["islands"].values()) == {result["checksum"]}
    assert all(r["tokens"] == 3 * 4 * 32 for r in result["rounds"]), result["rounds"]  # H x batch x seq per round


@pytest.mark.integration
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a sharded island over NCCL needs two GPUs")
@pytest.mark.timeout(300)
def test_sharded_island_over_nccl_beside_a_one_rank_island(tmp_path):
    result = run_scenario("fsdp_scenarios.py", "cuda", tmp_path, 260, "2", "1")
    assert result["notes"]["exit_codes"] == {"sharded": 0, "single": 0}
    assert all(len(r["islands"]) == 2 and r["elements_folded"] == r["elements_expected"] for r in result["rounds"])
    assert set(result["islands"].values()) == {result["checksum"]}


@pytest.mark.integration
@needs_cuda
def test_fsdp2_on_cuda_computes_in_bf16_over_fp32_masters():
    """One rank, NCCL: the sharded model's loss and gradients track the fp32 model's at bf16 precision."""
    from islands.fsdp import build_sharded_model, local_flat, shard_range

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    cfg = tiny_config("model.d_model=128", "model.n_heads=4", "model.d_ff=256", "model.n_layers=2").model
    torch.manual_seed(0)
    from diloco.models.llama import Transformer

    reference = Transformer(cfg)
    inputs = torch.randint(0, cfg.vocab_size, (4, 32))
    targets = torch.randint(0, cfg.vocab_size, (4, 32))
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        model, _ = build_sharded_model(cfg, torch.device("cuda:0"), 1)
        ref = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            r = shard_range(name, p)
            local_flat(p).copy_(ref[name].detach().reshape(-1)[r.offset:r.offset + r.numel])
        _, loss = model(inputs.cuda(), targets.cuda())
        loss.backward()
        _, ref_loss = reference(inputs, targets)
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item(), (loss.item(), ref_loss.item())
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name  # fp32 masters and reduced grads
            g, g_ref = local_flat(p.grad).cpu(), ref[name].grad.reshape(-1)
            cos = torch.nn.functional.cosine_similarity(g, g_ref, dim=0).item()
            assert cos > 0.99, (name, cos)  # bf16 compute: close to, not equal to, the fp32 gradient
    finally:
        dist.destroy_process_group()
