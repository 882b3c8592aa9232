"""One island for every kind: the same round protocol, whatever the island is made of.

Each kind (one rank; one replica group of 2 FSDP ranks; 2 groups x 2 ranks) goes
through the same run (tests/island_scenarios.py): it joins mid-run, the
coordinator restarts mid-round, its push is refused because the round closed,
its copy of theta_global diverges and it resyncs, it leaves with its stats, and
a second island joins the finished run. Every kind must end holding exactly the
coordinator's parameters. Resuming from a checkpoint is the same test for every
kind too (tests/test_shard_checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_scenario


def _shards(reports: Path, key: str) -> dict[tuple[int, int], dict]:
    """(group, rank) -> the final shards of each rank's last attempt."""
    out = {}
    for summary in sorted(reports.glob("g*-r*-a*.json")):
        group, rank, _ = (int(p[1:]) for p in summary.stem.split("-"))
        out[(group, rank)] = (json.loads(summary.read_text()), torch.load(summary.with_suffix(".pt"))[key])
    return out


def _assemble(reports: Path, key: str) -> dict[int, dict[str, torch.Tensor]]:
    """Each group's full parameters, put together from its ranks' final shards (only here, in the test)."""
    groups: dict[int, dict[str, list]] = {}
    for (group, _), (summary, shards) in _shards(reports, key).items():
        for name, offset, numel in summary["ranges"]:
            groups.setdefault(group, {}).setdefault(name, []).append((offset, shards[name].reshape(-1)))
            assert shards[name].numel() == numel
    return {g: {n: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for n, p in parts.items()} for g, parts in groups.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["1", "1x2", "2x2"])
def test_every_kind_of_island_goes_through_the_same_round_protocol(tmp_path, kind):
    result = run_scenario("island_scenarios.py", "protocol", tmp_path, 280, kind)
    notes, island = result["notes"], result["notes"]["island"]
    assert notes["exit_codes"] == {"island": 0}
    rounds = {r["round"]: r for r in result["rounds"]}
    assert sorted(rounds) == list(range(6))
    for r in rounds.values():
        assert r["elements_folded"] == r["elements_expected"] > 0, r  # never part of a contribution
    # Joined after round 0; its round-3 push came after the deadline had closed the round without it.
    assert [r for r in range(6) if island in rounds[r]["islands"]] == [1, 2, 4, 5]
    events = result["events"]
    assert events["restarts"] == 1 and events["late_pushes"] >= 1
    log = (tmp_path / "island.log").read_text()
    assert "ROUND_CLOSED" in log, "the late push was not refused as ROUND_CLOSED"
    assert "differ from the coordinator's" in log, "the perturbed copy was not caught by the checksum"
    assert "pushing fragment 0 round 2 again" in log, "the island did not push again after the coordinator restarted"
    # It left with its stats, holding exactly the coordinator's parameters: every rank of every group.
    stats = result["island_stats"][island]
    assert stats["inner_steps"] == 18 and 0 < stats["compute_s"] < stats["wall_s"], stats
    assert result["islands"][island] == result["checksum"]
    coordinator = torch.load(tmp_path / "coordinator.pt")
    for key in ("model", "global"):
        for group, params in _assemble(tmp_path / "island", key).items():
            for name, t in coordinator.items():
                assert torch.equal(params[name], t.reshape(-1)), f"kind {kind} group {group} {key}: {name} differs"
    resyncs = {tag: s["state"]["resyncs"] for tag, (s, _) in
               ((f"g{g}-r{r}", v) for (g, r), v in _shards(tmp_path / "island", "model").items())}
    assert all(n >= 2 for n in resyncs.values()), resyncs
    # A second island of the same kind joining the finished run exits quietly.
    assert result["late"]["code"] == 0 and "the run has finished; nothing to do" in result["late"]["output"], result["late"]
