"""The island launcher is the island: its torchrun and ranks die with it, and a second copy is refused.

The run with real ranks (tests/fsdp_scenarios.py `launcher_killed`) starts inside a user + network + PID
namespace with only loopback, as the other sharded-island scenarios do; the rest runs here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_scenario
from islands.launch import LAUNCHER_ENV, IslandLock, LaunchError, claim_island

ROOT = Path(__file__).resolve().parents[1]
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "SLURM", "DILOCO", "TORCH"))}


@pytest.fixture(scope="module")
def launcher_killed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("launcher_killed")
    return workdir, run_scenario("fsdp_scenarios.py", "launcher_killed", workdir, 240)["notes"]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_sigkill_of_the_launcher_takes_torchrun_and_the_ranks_with_it(launcher_killed):
    workdir, notes = launcher_killed
    # The ranks were torchrun's children, torchrun the launcher's.
    assert len(notes["ranks"]) == 2 and len(notes["torchruns"]) == 1, notes
    assert notes["torchrun_parents"] == [notes["launcher"]], notes
    # Within the bound (60 s) every one of them was gone, killed by its parent-death signal (SIGKILL).
    assert notes["remaining"] == {}, f"left running after the launcher's SIGKILL: {notes['remaining']} (logs in {workdir})"
    watched = {str(pid) for pid in notes["torchruns"] + notes["ranks"]}
    assert set(notes["how"]) == watched and set(notes["how"].values()) == {f"signal {int(signal.SIGKILL)}"}, notes["how"]
    assert notes["lock_free_after"], "the launcher's lock outlived it"
    print(f"\nSIGKILL of the launcher -> last process of the island gone after {max(notes['gone_s'].values()):.3f} s "
          f"({notes['gone_s']})")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_second_copy_with_the_same_checkpoint_is_refused_while_the_first_runs(launcher_killed):
    workdir, notes = launcher_killed
    second = notes["second"]
    lines = second["log"].strip().splitlines()
    assert second["code"] == 2, second
    assert len(lines) == 1, lines
    assert f"another copy of this island is running (pid {notes['launcher']}" in lines[0], lines
    assert "--checkpoint" in lines[0] and "stop that copy first" in lines[0], lines
    # Refused before joining: the coordinator saw one island, and the first copy ran on undisturbed.
    assert second["joined_after"] == notes["joined"] == 1 and second["first_alive"], second


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_multi_rank_island_refused_at_join_ends_in_one_line_without_restarts(tmp_path):
    """A refusal that cannot change (here CONFIG_MISMATCH) ends a 2-rank island as it ends a 1-rank one: exit 2 and
    one error line, the launcher's, with no torchrun restart and no traceback."""
    notes = run_scenario("fsdp_scenarios.py", "refused_at_join", tmp_path, 240)["notes"]
    lines = notes["log"].strip().splitlines()
    errors = [line for line in lines if line.startswith("diloco-island:") or "error" in line.lower()]
    assert notes["code"] == 2, notes["log"]
    assert len(errors) == 1 and "CONFIG_MISMATCH" in errors[0] and errors[0] == lines[-1], notes["log"]
    assert "Traceback" not in notes["log"] and "Restarting" not in notes["log"], notes["log"]


def _join(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "islands", "join", "--coordinator", "127.0.0.1:9", "--device", "cpu", *args],
                          env=CLEAN_ENV, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.integration
def test_a_one_rank_island_is_refused_while_its_checkpoint_is_locked(tmp_path):
    ckpt = tmp_path / "ckpt"
    lock = IslandLock.acquire(str(ckpt))
    try:
        assert Path(lock.path) == ckpt / "island.lock"
        assert (ckpt / "island.lock").read_text().strip() == str(os.getpid())
        out = _join("--checkpoint", str(ckpt), "--resume")
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and f"another copy of this island is running (pid {os.getpid()}, holding {lock.path})" in lines[0], lines
        # The same URL written another way is the same island.
        with pytest.raises(LaunchError, match="another copy"):
            IslandLock.acquire(f"file://{ckpt}/")
    finally:
        lock.release()
    # Released (as by the holder's death), the next copy takes it.
    IslandLock.acquire(str(ckpt)).release()


@pytest.mark.unit
def test_a_remote_checkpoint_is_locked_on_this_machine(tmp_path, monkeypatch):
    """s3:// cannot hold a lock: the lock is a local file named by the URL, which refuses copies on this machine only."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    a = IslandLock.path_for("s3://bucket/run/island-0")
    assert Path(a).parent == tmp_path / "diloco-islands"
    assert IslandLock.path_for("s3://bucket/run/island-0/") == a != IslandLock.path_for("s3://bucket/run/island-1")
    lock = IslandLock.acquire("s3://bucket/run/island-0")
    try:
        with pytest.raises(LaunchError, match=r"another copy of this island is running \(pid \d+"):
            IslandLock.acquire("s3://bucket/run/island-0")
        IslandLock.acquire("s3://bucket/run/island-1").release()
    finally:
        lock.release()


@pytest.mark.unit
def test_an_island_without_a_checkpoint_takes_no_lock():
    assert claim_island(False, "") is None


# A rank started by torchrun: the parent-death signal is set and the launcher checked (Linux).
RANK_PROBE = (
    "import ctypes, os, sys; from islands.launch import die_with_parent; die_with_parent(); "
    "v = ctypes.c_int(0); ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(v), 0, 0, 0); print(v.value)"
)


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_under_the_launcher_dies_with_its_parent_or_exits_if_the_launcher_is_gone():
    base = {**CLEAN_ENV, "PYTHONPATH": str(ROOT), "TORCHELASTIC_RUN_ID": "x"}
    probe = [sys.executable, "-c", RANK_PROBE]
    # Here the probe's parent is pytest and its parent's parent this process's parent: "the launcher" when
    # named so, and its torchrun (pytest) is alive: the rank goes on with SIGKILL as its parent-death signal.
    ok = subprocess.run(probe, env={**base, LAUNCHER_ENV: str(os.getppid())}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == str(int(signal.SIGKILL)), ok
    # Its parent's parent is not the launcher named: torchrun was orphaned (or died) before the signal was set.
    gone = subprocess.run(probe, env={**base, LAUNCHER_ENV: "999999999"}, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "its torchrun or launcher is gone" in gone.stderr, gone
    # Under a torchrun of one's own (no launcher named), the signal is set and nothing is checked.
    own = subprocess.run(probe, env=base, capture_output=True, text=True, timeout=60)
    assert own.returncode == 0 and own.stdout.strip() == str(int(signal.SIGKILL)), own
    # Not started by torchrun (a one-rank island, or srun's): nothing is set.
    plain = subprocess.run(probe, env={k: v for k, v in base.items() if k != "TORCHELASTIC_RUN_ID"},
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stdout.strip() == "0", plain
