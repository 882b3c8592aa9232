"""A coordinator of K shard processes (docs/sharding.md) gives the global parameters, momentum and checksums of the
one-process coordinator, bit for bit; its followers admit only islands holding the leader's ticket."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager

import grpc
import pytest
import torch
from conftest import tiny_config
from kit import islands_on_threads

from coordinator.launch import MAX_RESTARTS, MAX_ROLL_BACKS, _wait, shard_ports
from coordinator.metrics import coordinator_metrics
from coordinator.server import start_coordinator
from coordinator.snapshot import run_snapshot
from coordinator.sharding import ShardRole
from diloco.fragments import layout_for
from diloco.params import checksum
from diloco.shardmap import ShardMap, join_checksums, ticket
from diloco.wire.refusal import Reason, refusal_of
from islands.client import CoordinatorClient
from islands.sim.simulation import children_of, shard_index
from islands.state import ReplicaSpec

pytestmark = pytest.mark.integration


@contextmanager
def coordinator_of(cfg, shards: int, tmp_path, **options):
    """The one-process coordinator (shards 0), or K shards on loopback; yields the list of them, leader first.
    options: start_coordinator's, the same for every shard (as `serve --shards K` passes its flags to each)."""
    with ExitStack() as stack:
        if shards == 0:
            c = start_coordinator(cfg, spool_dir=str(tmp_path / "spool"), **options)
            stack.callback(c.stop)
            yield [c]
            return
        ports = shard_ports("127.0.0.1", 0, shards)
        addresses, secret = tuple(f"127.0.0.1:{p}" for p in ports), os.urandom(32)
        running = []
        for i, port in enumerate(ports):
            # Each shard its own copy of the config, as each shard process reads its own: what one resolves at start
            # (the token corpus's vocabulary) the others must resolve themselves.
            c = start_coordinator(copy.deepcopy(cfg), port=port, spool_dir=str(tmp_path / f"spool-{i}"),
                                  shard=ShardRole(i, addresses, secret), **options)
            stack.callback(c.stop)
            running.append(c)
        yield running


def run(cfg, shards: int, tmp_path, islands: int = 2) -> dict:
    """Runs islands to the end against the coordinator; returns its parameters, momentum and fragment checksums."""
    with coordinator_of(cfg, shards, tmp_path / f"k{shards}") as running:
        specs = [ReplicaSpec(0, 1, f"island-{i}") for i in range(islands)]
        with islands_on_threads(running if shards else running[0], cfg, specs) as (_, results):
            pass
        assert len(results) == islands and all(r.checksum_matches for r in results.values()), results
        for c in running:
            assert c.wait(60), "a shard did not finish"
        params, momentum = {}, {}
        for c in running:
            params.update(c.state.params)
            for f in c.state.fragments:
                for name, p in f.outer.params.items():
                    momentum[name] = f.outer.optimizer.state[p]["momentum_buffer"]
        sums = [join_checksums([c.state.fragments[f].checksum for c in running]) for f in range(len(running[0].state.fragments))]
        rounds = [c.state.round for c in running]
        # The leader evaluates the whole model (rounds not evaluated: None).
        evals = [(s.round, s.fragment, None if math.isnan(s.eval_loss) else s.eval_loss) for s in running[0].state.summaries]
        # The leader's summaries are the run's (every shard's part added): elements folded as one process folds them.
        folded = [(s.round, s.fragment, s.elements_folded, s.elements_expected, s.bytes_up > 0) for s in running[0].state.summaries]
        rows = run_snapshot(running[0].state)["shards"]  # the leader's dashboard: a row per shard
        metrics = coordinator_metrics(running[0].state)()[0].decode()
        return {"params": params, "momentum": momentum, "checksums": sums, "rounds": rounds, "evals": evals, "folded": folded,
                "rows": rows, "metrics": metrics, "own_bytes": [sum(s.bytes_up for s in c.state.summaries) for c in running[1:]],
                "last_checksum": running[0].state.summaries[-1].checksum, "bytes_up": [s.bytes_up for s in running[0].state.summaries],
                "bytes_down": [s.bytes_down for s in running[0].state.summaries],
                "initial_eval": running[0].state.initial_eval_loss, "finals": [r.checksum for r in results.values()]}


def assert_same_run(sharded: dict, reference: dict, cfg, shards: int) -> None:
    assert sharded["params"].keys() == reference["params"].keys()
    for name, t in reference["params"].items():
        assert torch.equal(sharded["params"][name], t), f"{name} differs from the one-process coordinator's"
        assert torch.equal(sharded["momentum"][name], reference["momentum"][name]), f"{name}'s momentum differs"
    assert set(sharded["rounds"]) == {cfg.rounds.rounds}
    # The leader's evaluation reads the other shards' parts: the one-process coordinator's figures, bit for bit. With
    # streaming, a wave's evaluation is left out when another fragment's next round closed on a shard before the leader
    # read it (here H/P = 1 inner step apart; docs/sharding.md); the run's last one always stands.
    assert sharded["initial_eval"] == reference["initial_eval"]
    if cfg.streaming.fragments == 1:
        assert sharded["evals"] == reference["evals"]
    assert [e[:2] for e in sharded["evals"]] == [e[:2] for e in reference["evals"]]
    assert all(got[2] in (None, want[2]) for got, want in zip(sharded["evals"], reference["evals"]))
    assert sharded["evals"][-1] == reference["evals"][-1] and reference["evals"][-1][2] is not None
    assert any(loss is not None for _, _, loss in reference["evals"])
    assert sharded["folded"] == reference["folded"]
    if shards > 1:  # the leader shows each shard's part: the followers' as they counted it, the leader's the rest
        rows = sharded["rows"]
        assert [r["shard"] for r in rows] == list(range(shards)) and all(r["round"] == cfg.rounds.rounds for r in rows)
        assert [r["bytes_up"] for r in rows[1:]] == sharded["own_bytes"] and rows[0]["bytes_up"] > 0
        assert sum(r["bytes_up"] for r in rows) == sum(sharded["bytes_up"])
        assert f'diloco_shard_bytes_total{{direction="up",shard="{shards - 1}"}} {float(rows[-1]["bytes_up"])}' in sharded["metrics"]
    assert sharded["last_checksum"] == join_checksums(parts_of_last(reference, cfg, shards))
    # Each shard's pushes carry a header of their own: the bytes are the one process's within a few hundred a round.
    assert all(abs(a - b) < 300 * shards * 2 for a, b in zip(sharded["bytes_up"], reference["bytes_up"])), (sharded["bytes_up"], reference["bytes_up"])
    # Down too: the leader's reads of the others' values for its evaluation are not the run's traffic.
    assert all(abs(a - b) < 300 * shards * 4 for a, b in zip(sharded["bytes_down"], reference["bytes_down"])), \
        (sharded["bytes_down"], reference["bytes_down"])
    # The run's checksum of each fragment is its shards' checksums of the one-process coordinator's parameters.
    layout = layout_for(reference["params"], cfg)
    shard_map = ShardMap.of(layout, {n: t.numel() for n, t in reference["params"].items()}, shards)
    for f, fragment in enumerate(layout):
        parts = [checksum({n: reference["params"][n] for n in fragment.names if shard_map.owner[n] == s}) for s in range(shards)]
        assert sharded["checksums"][f] == join_checksums(parts)


def parts_of_last(reference: dict, cfg, shards: int) -> list[str]:
    """The shards' checksums of the fragment that closed last, from the one-process run's parameters."""
    layout = layout_for(reference["params"], cfg)
    shard_map = ShardMap.of(layout, {n: t.numel() for n, t in reference["params"].items()}, shards)
    names = layout[reference["folded"][-1][1]].names
    return [checksum({n: reference["params"][n] for n in names if shard_map.owner[n] == s}) for s in range(shards)]


# fp32 and the 4-bit codec, plain and with streaming fragments; 2 islands each (the norm guard judging every round).
CASES = {
    "fp32": (),
    "e3m0": ("wire.codec=e3m0",),
    "streaming": ("model.n_layers=3", "streaming.fragments=3", "inner.steps_per_round=3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_k_shards_give_the_one_process_coordinators_parameters_momentum_and_checksums(case, tmp_path):
    cfg = tiny_config("rounds.rounds=3", "eval.batches=2", *CASES[case])  # evaluated: the leader reads every part
    reference = run(cfg, 0, tmp_path)
    for shards in (1, 2, 3):
        assert_same_run(run(cfg, shards, tmp_path), reference, cfg, shards)



def test_with_three_islands_the_shards_direction_sketches_add_up_to_every_contribution(tmp_path, monkeypatch):
    """From three members on, each shard sketches its part of every push and the leader judges directions on the
    sum (coordinator/judging.py): every contribution is judged with a whole sketch, and the run is one process's."""
    from diloco.robust import NormGuard

    judged: list[tuple[int, int]] = []  # (contributions, whole sketches) of each judgment
    real_judge = NormGuard.judge

    def judge(self, norms, label="", sketches=None):
        judged.append((len(norms), len(sketches or {})))
        return real_judge(self, norms, label, sketches)

    monkeypatch.setattr(NormGuard, "judge", judge)
    cfg = tiny_config("rounds.rounds=3", "eval.batches=2", "wire.codec=e3m0", "rounds.min_islands=3")
    reference = run(cfg, 0, tmp_path, islands=3)
    assert judged == [(3, 3)] * cfg.rounds.rounds
    for shards in (2, 3):
        judged.clear()
        assert_same_run(run(cfg, shards, tmp_path, islands=3), reference, cfg, shards)
        assert judged == [(3, 3)] * cfg.rounds.rounds, f"K = {shards}: {judged}"

def test_a_member_pushing_to_the_leader_only_is_folded_on_no_shard_and_holds_no_round(tmp_path, monkeypatch):
    """A member holding a valid key that pushes its part to the leading shard and never to the follower: the follower
    closes each round when the leader did (CloseRound), not at its deadline, and the contribution, whole on one shard
    only, is dropped on both, so the shards' parameters stay the ones a run of the honest islands alone gives."""
    from islands.island import Island
    from islands.sharded import ShardedClient
    from diloco.shardmap import split_checksum
    from diloco.v1 import diloco_pb2 as pb

    real_push = ShardedClient.push

    def leader_only(self, header, chunks):
        if header.island_id != "island-2":
            return real_push(self, header, chunks)
        own = pb.PushHeader()
        own.CopyFrom(header)
        own.global_checksum = split_checksum(header.global_checksum, self.map.shards)[0]
        return self.leader.push(own, chunks.only(frozenset(self.map.names(0))))

    real_run = Island.run

    def run_island(self):
        # The attacker, idle on the follower, is removed from it and ends refused there (NOT_FOUND): the test is
        # about the honest islands and the shards.
        try:
            return real_run(self)
        except grpc.RpcError:
            if self.island_id != "island-2":
                raise

    monkeypatch.setattr(ShardedClient, "push", leader_only)
    monkeypatch.setattr(Island, "run", run_island)
    # A deadline no round may reach in the test (a round here takes well under a second): hitting it fails the test.
    cfg = tiny_config("rounds.rounds=4", "rounds.min_islands=2", "rounds.deadline_s=120")
    reference = run(cfg, 0, tmp_path / "honest")  # the two honest islands alone
    with coordinator_of(cfg, 2, tmp_path / "k2") as running:
        specs = [ReplicaSpec(0, 1, f"island-{i}") for i in range(3)]
        with islands_on_threads(running, cfg, specs) as (_, results):
            pass
        assert all(c.wait(60) for c in running), "a shard did not finish"
        reasons = [f.last_close_reason for c in running for f in c.state.fragments]
        summaries = running[0].state.summaries
        params = {n: t for c in running for n, t in c.state.params.items()}
    assert reasons == ["every live island contributed", "the leading shard closed the round"], reasons
    assert all("island-2" in s.dropped and "island-2" not in s.islands for s in summaries), [list(s.dropped) for s in summaries]
    assert all(s.seconds < cfg.rounds.deadline_s for s in summaries)
    for name, t in reference["params"].items():
        assert torch.equal(params[name], t), f"{name}: a shard folded the partial contribution"
    assert [results[i].checksum_matches for i in (0, 1)] == [True, True], results


def test_shards_on_a_token_corpus_each_take_the_corpuss_vocabulary_and_admit_the_island(tmp_path):
    """model.vocab_size = 0 takes the corpus's vocabulary: every shard resolves it, not only the leader that keeps the
    ledger, so every shard serves the same model and config digest and a follower does not refuse the island."""
    from kit import write_corpus

    from diloco.data.shards import read_manifest
    from diloco.data.sources import resolve_vocab

    corpus = write_corpus(tmp_path / "corpus")
    cfg = tiny_config("data.source=tokens", f"data.url={corpus!r}", "model.vocab_size=0",
                      f"data.cache_dir={str(tmp_path / 'cache')!r}", "data.shuffle_block=8", "rounds.rounds=2",
                      "robust.first_quorum=1")  # one island
    island_cfg = copy.deepcopy(cfg)
    resolve_vocab(island_cfg)  # as an island does at start (islands/joining.py)
    with coordinator_of(cfg, 2, tmp_path) as running:
        assert [c.state.cfg.model.vocab_size for c in running] == [read_manifest(corpus)[0].vocab_size] * 2
        with islands_on_threads(running, island_cfg, [ReplicaSpec(0, 1, "island-0")]) as (_, results):
            pass
        assert results[0].rounds == 2 and results[0].checksum_matches, results
        assert all(c.wait(60) for c in running), "a shard did not finish"


def test_shards_given_one_log_and_audit_location_each_write_in_a_folder_of_their_own(tmp_path):
    """`serve --shards K --log-url U --audit A` gives every shard U and A; parts are named by their start second, so
    shards started together would overwrite each other's: each writes under U/shard-I-of-K/ (as its checkpoints)."""
    from coordinator.server import Observe

    cfg = tiny_config("rounds.rounds=2", "robust.first_quorum=1")  # one island
    logs, audit = tmp_path / "logs", tmp_path / "audit"
    with coordinator_of(cfg, 2, tmp_path, audit_url=str(audit), observe=Observe(log_url=str(logs))) as running:
        with islands_on_threads(running, cfg, [ReplicaSpec(0, 1, "island-0")]) as (_, results):
            pass
        assert results[0].checksum_matches and all(c.wait(60) for c in running)
        parts = [c.state.fragments[0].checksum for c in running]
    # Stopped (coordinator_of's exit): every log written whole.
    for where, prefix in ((logs, "rounds"), (audit, "audit")):
        assert sorted(p.name for p in where.iterdir()) == ["shard-0-of-2", "shard-1-of-2"], f"{where}: {list(where.iterdir())}"
    for i in range(2):
        records = [json.loads(line) for part in sorted((logs / f"shard-{i}-of-2").glob("rounds-*.jsonl"))
                   for line in part.read_text().splitlines()]
        rounds = [r for r in records if r["event"] == "round"]
        assert [r["round"] for r in rounds] == [0, 1], f"shard {i}: {records}"
        # The leader's lines are the run's (every shard's part joined), a follower's its own part.
        assert rounds[-1]["checksum"] == (join_checksums(parts) if i == 0 else parts[1])
        events = [json.loads(line)["event"] for part in sorted((audit / f"shard-{i}-of-2").glob("audit-*.jsonl"))
                  for line in part.read_text().splitlines()]
        assert "join" in events and "leave" in events, f"shard {i}: {events}"


def test_a_following_shard_admits_only_the_leaders_ticket(tmp_path):
    cfg = tiny_config()
    with coordinator_of(cfg, 2, tmp_path) as (leader, follower):
        client = CoordinatorClient(f"127.0.0.1:{follower.port}", connect_timeout_s=10)
        try:
            for presented in ("", ticket(b"not the shards' secret" * 2, "island-0", "", 1)):
                with pytest.raises(grpc.RpcError) as refused:
                    client.join(cfg.digest(), island_id="island-0", shard_ticket=presented)
                assert refusal_of(refused.value).reason == Reason.NOT_YOURS
                assert "join there" in refused.value.details()
            # The leader's ticket for one island does not admit another id, nor more ranks.
            joined = CoordinatorClient(f"127.0.0.1:{leader.port}", connect_timeout_s=10)
            reply = joined.join(cfg.digest())
            assert list(reply.shard_addresses) == [f"127.0.0.1:{leader.port}", f"127.0.0.1:{follower.port}"]
            for island_id, ranks in (("island-7", 1), (reply.island_id, 4)):
                with pytest.raises(grpc.RpcError) as refused:
                    client.join(cfg.digest(), island_id=island_id, ranks=ranks, shard_ticket=reply.shard_ticket)
                assert refusal_of(refused.value).reason == Reason.NOT_YOURS
            assert not follower.state.islands
            admitted = client.join(cfg.digest(), island_id=reply.island_id, shard_ticket=reply.shard_ticket)
            assert admitted.island_id == reply.island_id and reply.island_id in follower.state.islands
            joined.close()
        finally:
            client.close()


def test_the_demo_with_a_sharded_coordinator_over_mutual_tls_ends_with_every_island_on_every_shards_parameters(tmp_path):
    """`diloco-sim --coordinator-shards 2` as a user runs it: `serve --shards 2` starts the shards, islands find the
    follower through the leader, all over mutual TLS; the round lines add up every shard's bytes. The run has one
    checksum, its shards' joined, and every place that shows it shows that one: the report `serve --shards 2` writes,
    the last round, each island's log."""
    import re

    from islands.sim.simulation import run_sim

    cfg = tiny_config("rounds.rounds=2", "rounds.min_islands=2", "data.shards=2")
    lines = []
    result = run_sim(cfg, islands=2, workdir=tmp_path, timeout_s=240, echo=lines.append, coordinator_shards=2)
    report = result.report
    assert json.loads((tmp_path / "report.json").read_text()) == report  # the launcher's: the run's
    shards = [json.loads((tmp_path / f"report.json.shard-{i}").read_text()) for i in range(2)]
    assert report["checksum"] == join_checksums([s["checksum"] for s in shards]) == report["rounds"][-1]["checksum"]
    assert set(report["islands"].values()) == {report["checksum"]} and len(report["islands"]) == 2
    for i in range(2):
        (said,) = re.findall(r"parameters checksum (\S+) \(matches", (tmp_path / f"island-{i}.log").read_text())
        assert said == report["checksum"], f"island {i} logged {said}, the report {report['checksum']}"
    for merged, follower in zip(report["rounds"], shards[1]["rounds"]):  # the leader's rounds are the run's
        assert merged["bytes_up"] > follower["bytes_up"] > 0, "every shard received pushes, the leader's round counts all"
        assert merged["checksum"].split("+")[1] == follower["checksum"]
    assert len((tmp_path / "port.shards").read_text().split()) == 2


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@contextmanager
def serving_shards(cfg, workdir, shards: int = 2, *flags: str):
    """`diloco-coordinator serve --shards K [flags]` as a process, once every shard serves; yields it and its log
    (every shard's output). Everything it started is killed at the end."""
    config, port_file, log_path = workdir / "run.toml", workdir / "port", workdir / "launcher.log"
    config.write_text(cfg.to_toml())
    with open(log_path, "w") as out:
        launcher = subprocess.Popen([sys.executable, "-m", "coordinator", "serve", "--config", str(config), "--host",
                                     "127.0.0.1", "--port", "0", "--port-file", str(port_file), "--http-port", "-1",
                                     "--shards", str(shards), *flags], env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=out,
                                    stderr=subprocess.STDOUT)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():  # written once every shard serves
            assert launcher.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "the shards did not start"
            time.sleep(0.1)
        children = children_of(launcher.pid)
        yield launcher, log_path
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(30)
        for pid in filter(running, children + children_of(launcher.pid)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's (diloco/cli/lifetime.py)")
def test_the_shards_of_a_sigkilled_serve_shards_k_launcher_die_with_it(tmp_path):
    """diloco-sim ends a failed sharded run by SIGKILLing `serve --shards K`: its shards must not serve on alone."""
    with serving_shards(tiny_config(), tmp_path) as (launcher, _):
        shards = children_of(launcher.pid)
        assert len(shards) == 2 and all(map(running, shards)), shards
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 60
        while any(map(running, shards)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, shards)), "a shard outlived its SIGKILLed launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the launcher's children")
def test_a_shard_killed_under_serve_shards_k_with_checkpoints_is_started_again_with_resume(tmp_path):
    """With --checkpoint, a shard SIGKILLed (the OOM killer, a crash) is started again with --resume and the others
    keep serving, as torchrun restarts a rank; without a checkpoint to resume from, a killed shard stops the rest."""
    with serving_shards(tiny_config(), tmp_path, 2, "--checkpoint", str(tmp_path / "ckpt")) as (launcher, log_path):
        before = {shard_index(p): p for p in children_of(launcher.pid)}
        os.kill(before[1], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "coordinator shard 1 of 2 serving" not in log_path.read_text().partition("was killed")[2]:
            assert launcher.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        after = {shard_index(p): p for p in children_of(launcher.pid)}
        assert after[0] == before[0] and after[1] != before[1] and all(map(running, after.values()))
        assert "--resume" in open(f"/proc/{after[1]}/cmdline").read().split("\0")
        assert "coordinator shard 1 was killed (signal 9); starting it again with --resume" in log_path.read_text()
    (tmp_path / "plain").mkdir()
    with serving_shards(tiny_config(), tmp_path / "plain", 2) as (launcher, log_path):
        os.kill({shard_index(p): p for p in children_of(launcher.pid)}[1], signal.SIGKILL)
        assert launcher.wait(120) != 0, log_path.read_text()
        assert "starting it again" not in log_path.read_text()


def test_the_launcher_restarts_a_rolled_back_shard_on_a_budget_of_its_own(tmp_path):
    """A shard that stops with 75 (to resume with the others) is started again with --resume, and these restarts do
    not use up the budget for shards killed by a signal (the issue-42 team run: two kills and a roll-back left none,
    and the launcher gave up on a run that could go on); each budget still bounds its kind."""
    def child(code: int) -> subprocess.Popen:
        if code < 0:
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            p.send_signal(-code)
            return p
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])

    def scripted(plan: list[int]):
        started = []

        def restart(i: int) -> subprocess.Popen:
            started.append(i)
            return child(plan.pop(0) if plan else 0)
        return restart, started

    # Shard 0: killed MAX_RESTARTS - 1 times, then rolled back MAX_ROLL_BACKS times, then ends well.
    restart, started = scripted([-9] * (MAX_RESTARTS - 2) + [75] * MAX_ROLL_BACKS)
    assert _wait([child(-9), child(0)], tmp_path, None, 2, "a:1,b:2", restart) == 0
    assert started == [0] * (MAX_RESTARTS - 1 + MAX_ROLL_BACKS)
    # A shard that keeps rolling back is stopped once its budget is spent: the run ends with 75, not a loop.
    restart, started = scripted([75] * MAX_ROLL_BACKS)
    assert _wait([child(75), child(0)], tmp_path, None, 2, "a:1,b:2", restart) == 75
    assert started == [0] * MAX_ROLL_BACKS


def test_each_shard_of_serve_shards_k_names_itself_in_its_log_lines(tmp_path):
    """The shards' lines share one stream: each is tagged with its shard, and a follower, which evaluates nothing,
    says who evaluates the initial parameters rather than logging a NaN loss."""
    with serving_shards(tiny_config("eval.batches=2"), tmp_path) as (launcher, log_path):
        launcher.send_signal(signal.SIGTERM)  # passed on to the shards: a clean stop
        assert launcher.wait(120) == 0, log_path.read_text()
    lines = log_path.read_text().splitlines()
    for i in range(2):
        assert any(f"[coordinator shard {i}] " in line and f"coordinator shard {i} of 2 serving" in line for line in lines), lines
    (leader,) = [line for line in lines if "[coordinator shard 0] " in line and "global parameters" in line]
    (follower,) = [line for line in lines if "[coordinator shard 1] " in line and "global parameters" in line]
    assert math.isfinite(float(leader.rsplit("initial eval loss ", 1)[1]))
    assert follower.endswith("initial eval loss evaluated by shard 0"), follower
    assert not any("nan" in line.split() for line in lines), lines


def two_island_rounds(*overrides: str):
    """6 rounds of 40 inner steps for two islands: a kill right after a checkpoint lands while they train the next."""
    return tiny_config("rounds.rounds=6", "rounds.min_islands=2", "data.shards=2", "inner.steps_per_round=40",
                       "rounds.heartbeat_s=0.5", *overrides)


class ShardProcesses:
    """A coordinator's shards started one by one as torchrun or SLURM would (`serve --shard I`), each its own process,
    and islands as `diloco-island join` processes; everything stopped in close()."""

    def __init__(self, cfg, shards: int, workdir):
        self.workdir, self.shards = workdir, shards
        self.ports = shard_ports("127.0.0.1", 0, shards)
        self.addresses = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        self.config = workdir / "run.toml"
        self.config.write_text(cfg.to_toml())
        self.tmp = workdir / "tmp"  # TMPDIR: where the shards make their spools
        self.tmp.mkdir()
        self.env = dict(os.environ, DILOCO_SHARD_SECRET=os.urandom(32).hex(), PYTHONUNBUFFERED="1", TMPDIR=str(self.tmp))
        self.procs: dict[str, subprocess.Popen] = {}

    def start_shard(self, i: int, resume: bool = False) -> None:
        port_file = self.workdir / f"port-{i}"
        port_file.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "coordinator", "serve", "--config", str(self.config), "--host", "127.0.0.1",
                "--port", str(self.ports[i]), "--shard", str(i), "--shards", str(self.shards), "--shard-addresses",
                self.addresses, "--checkpoint", str(self.workdir / "ckpt"), "--report", str(self.workdir / f"report-{i}.json"),
                "--port-file", str(port_file), "--http-port", "-1", "--linger", "30", "--threads", "1",
                *(["--resume"] if resume else [])]
        self.procs[f"shard-{i}"] = self._spawn(argv, f"shard-{i}.log")
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert self.procs[f"shard-{i}"].poll() is None, f"shard {i} exited; see {self.workdir}{self.tails()}"
            assert time.monotonic() < deadline, f"shard {i} did not start"
            time.sleep(0.1)

    def start_all(self) -> None:
        """Every shard, then two islands."""
        for i in range(self.shards):
            self.start_shard(i)
        for i in range(2):
            self.start_island(i)

    def start_island(self, i: int) -> None:
        argv = [sys.executable, "-m", "islands", "join", "--coordinator", f"127.0.0.1:{self.ports[0]}", "--config",
                str(self.config), "--device", "cpu", "--threads", "1", "--connect-timeout", "60"]
        self.procs[f"island-{i}"] = self._spawn(argv, f"island-{i}.log")

    def _spawn(self, argv, log_name: str) -> subprocess.Popen:
        with open(self.workdir / log_name, "a") as out:
            return subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def committed(self, shard: int, step: int) -> bool:
        return (self.workdir / "ckpt" / f"shard-{shard}-of-{self.shards}" / f"step-{step:010d}" / "COMMITTED").exists()

    def kill_after(self, shard: int, step: int, timeout_s: float = 120) -> None:
        """SIGKILLs the shard as soon as it committed checkpoint `step` (mid-round: the islands are training the next)."""
        deadline = time.monotonic() + timeout_s
        while not self.committed(shard, step):
            assert time.monotonic() < deadline, f"shard {shard} never committed step {step}; see {self.workdir}{self.tails()}"
            time.sleep(0.01)
        self.procs[f"shard-{shard}"].send_signal(signal.SIGKILL)
        self.procs[f"shard-{shard}"].wait(30)

    def wait_all(self, timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        return {name: p.wait(max(1.0, deadline - time.monotonic())) for name, p in self.procs.items()}

    def tails(self, lines: int = 15) -> str:
        """The end of every process's log: what a failure in CI shows, whose tmp_path is gone by the time it is read."""
        return "".join(f"\n--- {name}.log ---\n" + "\n".join((self.workdir / f"{name}.log").read_text().splitlines()[-lines:])
                       for name in self.procs)

    def assert_ended_whole(self, codes: dict[str, int], rounds: int) -> None:
        """Every process exited 0; every shard's report ends at the last round with both islands on its checksum, and
        each island's log says it holds the coordinator's parameters."""
        assert codes == {"shard-0": 0, "shard-1": 0, "island-0": 0, "island-1": 0}, f"see {self.workdir}{self.tails()}"
        for i in range(self.shards):
            report = json.loads((self.workdir / f"report-{i}.json").read_text())
            assert report["final_round"] == rounds, f"shard {i} ended at round {report['final_round']}{self.tails()}"
            assert len(report["islands"]) == 2 and set(report["islands"].values()) == {report["checksum"]}
        for i in range(2):
            assert "matches the coordinator's" in (self.workdir / f"island-{i}.log").read_text()

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)


@pytest.mark.timeout(400)
def test_a_follower_and_then_the_leader_sigkilled_mid_round_resume_while_the_others_keep_serving(tmp_path):
    run = ShardProcesses(two_island_rounds("checkpoint.every_rounds=1"), 2, tmp_path)
    try:
        run.start_all()
        run.kill_after(1, step=2)
        run.start_shard(1, resume=True)
        run.kill_after(0, step=4)
        run.start_shard(0, resume=True)
        codes = run.wait_all(300)
    finally:
        run.close()
    run.assert_ended_whole(codes, rounds=6)
    assert "resumed from" in (tmp_path / "shard-1.log").read_text() and "resumed from" in (tmp_path / "shard-0.log").read_text()
    # Each killed shard's spool was removed by its restart; the others by their own clean stops.
    assert list(run.tmp.glob("diloco-spool-*")) == []
    assert "did not stop cleanly" in (tmp_path / "shard-1.log").read_text()


@pytest.mark.timeout(500)
@pytest.mark.parametrize("killed, seen", [
    (1, "coordinator shard 1 came back at fragment rounds {0: 2}, behind rounds it had closed"),
    pytest.param(0, "coordinator shard 1 closed fragment 0's round 2, which this leading shard has not",
                 marks=pytest.mark.slow),  # the same path from the leader's side
])
def test_a_shard_killed_after_a_close_its_checkpoint_missed_rolls_every_shard_back_and_the_run_ends_whole(
        killed, seen, tmp_path):
    """A shard SIGKILLed after publishing a round no checkpoint of it holds (checkpoints every 2 rounds; the same
    window is open between any close and its checkpoint) comes back a round behind the islands and the other shard.
    The leader sees it, tells the shards to resume together (exit 75, as torchrun or a StatefulSet would restart them),
    and the islands go back with them: the run ends with every shard, island and report on one checksum."""
    run = ShardProcesses(two_island_rounds("checkpoint.every_rounds=2"), 2, tmp_path)
    try:
        run.start_all()
        deadline = time.monotonic() + 200
        # Rounds 0-1 are in step 2; round 2 in none. The leader logs its close once the follower's summary of it came
        # (the follower closes after the leader, and logs before its watchers hear: a kill at its own line could beat
        # the summary to the leader, a window of milliseconds docs/sharding.md leaves open).
        while "round 2 closed" not in (tmp_path / "shard-0.log").read_text():
            assert time.monotonic() < deadline, f"shard 0 never closed round 2{run.tails()}"
            time.sleep(0.01)
        assert "round 2's summary has 1 of 2 shards' figures" not in (tmp_path / "shard-0.log").read_text()
        run.procs[f"shard-{killed}"].send_signal(signal.SIGKILL)
        run.procs[f"shard-{killed}"].wait(30)
        assert not run.committed(killed, 3) and not run.committed(killed, 4)
        run.start_shard(killed, resume=True)
        # Both stop to be resumed together; the test restarts them as their launcher would.
        for i in (0, 1):
            code = run.procs[f"shard-{i}"].wait(120)
            assert code == 75, f"shard {i} exited {code}, not to roll back{run.tails()}"
        for i in (0, 1):
            run.start_shard(i, resume=True)
        codes = run.wait_all(300)
    finally:
        run.close()
    run.assert_ended_whole(codes, rounds=6)
    assert seen in (tmp_path / "shard-0.log").read_text(), run.tails()
    assert "the leading shard rolls the shards back" in (tmp_path / "shard-1.log").read_text()


def test_only_the_shards_own_signed_statistics_reach_the_leaders_judge(tmp_path):
    """A member (or anyone on the port) cannot feed the leader statistics that would clip or drop other islands:
    Judge takes only calls signed with the shards' secret, and a one-process coordinator takes none."""
    from coordinator.judging import proof
    from diloco.v1 import diloco_pb2 as pb
    from diloco.v1 import diloco_pb2_grpc as pb_grpc

    cfg = tiny_config()
    forged = pb.ContributionStats(key="island-0", sumsq_parts=[1e30], lr_sum=1.0)
    with coordinator_of(cfg, 2, tmp_path / "k2") as (leader, _), coordinator_of(cfg, 0, tmp_path / "k0") as (alone,):
        guessed = proof(b"a guess at the secret" * 2, pb.JudgeRequest(fragment=0, round=0, shard=1, contributions=[forged]))
        for target, signed in ((leader, guessed), (leader, ""), (alone, "")):
            with grpc.insecure_channel(f"127.0.0.1:{target.port}") as channel, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(channel).Judge(
                    pb.JudgeRequest(fragment=0, round=0, shard=1, proof=signed, contributions=[forged]), timeout=30)
            assert refusal_of(refused.value).reason == Reason.NOT_YOURS
        judge = leader.shard_services.judging.leader
        # Signed, but pieces that cannot be: refused as a bad request before anything is kept.
        for piece, pieces in ((2, 2), (-1, 2), (0, 1 << 20)):
            request = pb.JudgeRequest(fragment=0, round=0, shard=1, contributions=[forged], piece=piece, pieces=pieces)
            request.proof = proof(judge.secret, request)
            with grpc.insecure_channel(f"127.0.0.1:{leader.port}") as channel, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.CoordinatorStub(channel).Judge(request, timeout=30)
            assert refusal_of(refused.value).reason == Reason.BAD_REQUEST, (piece, pieces)
        assert not judge.parts and not judge.verdicts and not judge.pieces


def test_a_sharded_runs_checkpoints_export_and_evaluate_as_one_model(tmp_path, capsys):
    """diloco-export and diloco-eval take a sharded coordinator's checkpoint.url as they take one process's: the
    shards' parts at the newest step every shard committed, put back together."""
    from kit import export_cli

    from diloco.cli.eval import main as eval_main
    from diloco.models.hf import from_hf_folder

    def config(url):
        # Evaluated too: the leader, which reads the others' parts for it, checkpoints only its own.
        return tiny_config("rounds.rounds=2", f"checkpoint.url={json.dumps(str(url))}", "checkpoint.every_rounds=1",
                           "eval.batches=2")

    sharded = run(config(tmp_path / "ckpt"), 3, tmp_path)
    run(config(tmp_path / "one"), 0, tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [f"shard-{i}-of-3" for i in range(3)]
    assert export_cli(tmp_path / "ckpt", tmp_path / "hf") == 0
    _, state = from_hf_folder(tmp_path / "hf")
    assert state.keys() == sharded["params"].keys() and all(torch.equal(state[n], t) for n, t in sharded["params"].items())
    reports = []
    for url in ("ckpt", "one"):
        assert eval_main([str(tmp_path / url), "--json", str(tmp_path / f"{url}.json"), "--device", "cpu"]) == 0
        reports.append(json.loads((tmp_path / f"{url}.json").read_text()))
    assert reports[0]["step"] == 2 and reports[0]["kind"] == "checkpoint", reports[0]
    assert math.isfinite(reports[0]["heldout"]["loss"]) and reports[0]["heldout"] == reports[1]["heldout"]
    # A shard's folder gone: one line naming it, not a model with a third of its parameters missing.
    import shutil

    shutil.rmtree(tmp_path / "ckpt" / "shard-1-of-3")
    capsys.readouterr()
    assert export_cli(tmp_path / "ckpt", tmp_path / "hf2") == 2
    assert "shards [1] wrote no checkpoint there" in capsys.readouterr().err
