"""A file-backed parameter copy (coordinator/filebacked.py): the values of ordinary tensors, its pages handed back."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from coordinator.filebacked import FileBackedParams, HandingBack
from diloco.params import CHECKSUM_SLICE, checksum, load_parameters

pytestmark = pytest.mark.unit


def mapped_resident_bytes() -> int:
    """This process's resident file and shared pages (where a mapped file's pages are counted)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssFile", "RssShmem"):
                found[key] = int(value.split()[0]) * 1024
    if len(found) < 2:
        pytest.skip("/proc/self/status has no RssFile/RssShmem here")
    return sum(found.values())


def test_holds_the_values_and_keeps_writes_after_handing_pages_back(tmp_path):
    like = {"w": torch.randn(3, 1000), "b": torch.randn(7), "e": torch.randn(0)}
    params = FileBackedParams(like, tmp_path)
    assert all(torch.equal(params.tensors[n], t) and params.tensors[n].shape == t.shape for n, t in like.items())
    assert list(tmp_path.iterdir()) == [], "the file is unlinked: nothing is left behind"
    flat = params.tensors["w"].view(-1)
    flat[100:2100] += 1.0
    params.release("w", 100, 2100)  # a span whose ends are inside pages: those pages keep their values
    params.release("b")
    params.release()
    assert torch.equal(params.tensors["w"].view(-1)[100:2100], like["w"].view(-1)[100:2100] + 1.0)
    assert torch.equal(params.tensors["w"].view(-1)[:100], like["w"].view(-1)[:100])
    assert torch.equal(params.tensors["w"].view(-1)[2100:], like["w"].view(-1)[2100:])
    assert torch.equal(params.tensors["b"], like["b"])


def test_a_use_hands_its_pages_back(tmp_path):
    n = 16 << 20  # 64 MiB of fp32
    before = mapped_resident_bytes()
    params = FileBackedParams({"w": torch.ones(n)}, tmp_path)
    assert mapped_resident_bytes() - before < 8 << 20, "made and released: not resident"
    t = params.tensors["w"]
    t.mul_(3.0)  # touches every page
    assert mapped_resident_bytes() - before > 48 << 20
    params.release("w")
    assert mapped_resident_bytes() - before < 8 << 20
    assert float(t.sum()) == 3.0 * n, "the values are read back from the file"
    params.release()


def test_a_disk_too_small_is_an_error_at_start_naming_what_to_do(tmp_path):
    """A real limit on the file's size (RLIMIT_FSIZE) in a process of its own: the blocks cannot be reserved."""
    code = f"""
import resource, signal, torch
from coordinator.filebacked import FileBackedParams, HandingBack
from diloco.params import CHECKSUM_SLICE, checksum, load_parameters
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    FileBackedParams({{"w": torch.zeros(1 << 20)}}, {str(tmp_path)!r})
except OSError as e:
    print("ERROR", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "cannot reserve 4 MiB" in out.stdout
    assert "published parameters" in out.stdout and "TMPDIR" in out.stdout


def test_a_whole_read_through_handing_back_holds_one_tensor_at_a_time(tmp_path):
    n = 8 << 20  # 32 MiB a tensor
    like = {name: torch.full((n,), float(k)) for k, name in enumerate("abc")}
    params = FileBackedParams(like, tmp_path)
    model = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.zeros(n)) for name in like})
    most = 0

    def release(name: str) -> None:
        nonlocal most
        most = max(most, mapped_resident_bytes() - before)
        params.release(name)

    before = mapped_resident_bytes()
    load_parameters(model, HandingBack(params.tensors, release))
    params.release()
    assert all(torch.equal(model[name].data, t) for name, t in like.items())
    assert (n * 4) * 0.75 < most < (n * 4) * 1.25, "each tensor was handed back before the next was read"


def test_a_checksum_a_slice_at_a_time_is_the_checksum(tmp_path):
    like = {"big": torch.randn(CHECKSUM_SLICE * 2 + 5), "small": torch.randn(3, 7), "none": torch.randn(0)}
    params = FileBackedParams(like, tmp_path)
    read: dict[str, list[tuple[int, int]]] = {}

    def after(name: str, lo: int, hi: int) -> None:
        read.setdefault(name, []).append((lo, hi))
        params.release(name, lo, hi)

    assert checksum(params.tensors, after) == checksum(like) == checksum(params.tensors)
    assert read == {"big": [(0, CHECKSUM_SLICE), (CHECKSUM_SLICE, 2 * CHECKSUM_SLICE), (2 * CHECKSUM_SLICE, 2 * CHECKSUM_SLICE + 5)],
                    "small": [(0, 21)]}
