"""Streaming DiLoCo with the claim check on, as users run it: no honest push refused, no round on 0 tokens.

A fragment's rounds are not all H steps long: its first is H - o_f, its last
H + o_f, and an island that joins or resumes mid-run starts every fragment at
the earliest of their round starts. Each inner step trains every fragment, so
over a run each fragment's rounds add up to every island's inner steps: the
token sums below say that no honest work was refused, pushed with no weight
or lost.
"""

from __future__ import annotations

import time

import pytest

from conftest import kill_all_and_resume, tiny_config
from kit import write_corpus
from islands.sim.simulation import Simulation, run_sim

pytestmark = pytest.mark.integration

PER_STEP = 4 * 32  # tiny_config: inner.batch_size x data.seq_len


def _config(fragments: int, tau: int, *extra: str):
    # 3 layers so that 3 fragments each hold a block; H = 6 so that every fragment has its own offset (0, 2, 4).
    return tiny_config("model.n_layers=3", "inner.steps_per_round=6", "rounds.rounds=4", "rounds.min_islands=2",
                       "data.shards=2", f"streaming.fragments={fragments}", f"streaming.tau={tau}", *extra)


def _fragment_tokens(report: dict) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in sorted(report["rounds"], key=lambda r: (r["fragment"], r["round"])):
        out.setdefault(r["fragment"], []).append(r["tokens"])
    return out


def _assert_honest(report: dict, fragments: int, rounds: int) -> dict[int, list[int]]:
    assert report["events"]["refusals"] == {}, report["events"]["refusals"]
    tokens = _fragment_tokens(report)
    assert sorted(tokens) == list(range(fragments))
    for f, per_round in tokens.items():
        assert len(per_round) == rounds, (f, per_round)
        assert all(t > 0 for t in per_round), f"fragment {f} closed a round on 0 tokens: {per_round}"
    assert set(report["islands"].values()) == {report["checksum"]}
    return tokens


@pytest.mark.parametrize("fragments,tau", [(2, 0), (2, 1), (3, 0), (3, 1)])
def test_fixed_schedule_folds_every_inner_step_of_every_fragment(tmp_path, fragments, tau):
    cfg = _config(fragments, tau)
    report = run_sim(cfg, 2, tmp_path, timeout_s=300, echo=lambda s: None).report
    tokens = _assert_honest(report, fragments, 4)
    trained = sum(s["inner_steps"] for s in report["island_stats"].values()) * PER_STEP
    assert trained == 2 * 4 * 6 * PER_STEP
    # Each inner step counts once towards each fragment: the last round (H + o_f steps) included.
    assert {f: sum(t) for f, t in tokens.items()} == {f: trained for f in range(fragments)}


def test_time_boxed_fragments_fold_every_inner_step(tmp_path):
    cfg = _config(2, 1, "rounds.mode='time'", "rounds.round_s=0.5", "inner.min_steps=1", "inner.max_steps=12")
    report = run_sim(cfg, 2, tmp_path, timeout_s=300, echo=lambda s: None).report
    tokens = _assert_honest(report, 2, 4)
    trained = sum(s["inner_steps"] for s in report["island_stats"].values()) * PER_STEP
    # Time-boxed, steps run on after a fragment's last round; what a round holds is never more than was trained.
    assert all(0 < sum(t) <= trained for t in tokens.values())


def test_resumed_islands_and_coordinator_lose_no_fold(tmp_path):
    """Everything SIGKILLed after round 1's checkpoints and resumed: the first pushes after the resume (a fragment's
    round that started before the kill) are taken with their weight, and no round closes on 0 tokens."""
    cfg = _config(2, 1, "rounds.rounds=5", "checkpoint.every_rounds=1", "rounds.heartbeat_s=0.5", "rounds.lease_s=8")
    sim = Simulation(cfg, 2, tmp_path, checkpoints=True)
    try:
        sim.start()
        kill_all_and_resume(sim, step=2, islands=2, timeout_s=120)
        for _ in sim.watch(300):
            pass
        report = sim.finish(300).report
    finally:
        sim.close()
    assert report["events"]["restarts"] == 1
    _assert_honest(report, 2, 5)


def _coordinator_killed_two_rounds_past_its_checkpoint(cfg, tmp_path) -> dict:
    """Two islands' run whose coordinator (checkpoint.every_rounds = 4) is SIGKILLed once fragment 0's round 5 closed
    and resumed: every_rounds counts each fragment's rounds, a checkpoint's step both fragments', so step 8 holds
    rounds 0-3 of each; the coordinator comes back at round 4, its islands at 6. Returns the run's report."""
    sim = Simulation(cfg, 2, tmp_path, checkpoints=True)
    committed = tmp_path / "ckpt" / "coordinator" / "step-0000000008" / "COMMITTED"
    try:
        sim.start()
        killed = False
        for summary in sim.watch(300):
            if not killed and summary.fragment == 0 and summary.round == 5:
                assert committed.exists(), "no coordinator checkpoint of rounds 0-3 before the kill"
                sim.kill_coordinator()
                sim.start_coordinator(resume=True)
                killed = True
        report = sim.finish(300).report
    finally:
        sim.close()
    assert killed and report["events"]["restarts"] == 1
    return report


def test_coordinator_restarted_behind_its_islands_replays_rounds_with_their_weight(tmp_path):
    """The coordinator alone SIGKILLed rounds after its last checkpoint: its islands are ahead of it when it is back.
    They go back to its rounds and train them again, so every replayed round folds both islands' full rounds: each
    fragment's tokens add up to the undisturbed run's, and only the islands' work since the checkpoint is lost."""
    rounds = 8
    cfg = _config(2, 1, f"rounds.rounds={rounds}", "checkpoint.every_rounds=4", "rounds.heartbeat_s=0.5",
                  "rounds.lease_s=30")
    report = _coordinator_killed_two_rounds_past_its_checkpoint(cfg, tmp_path)
    refused = report["events"]["refusals"]
    assert set(refused) <= {"ROUND_AHEAD", "PUSH_AGAIN"}, refused  # islands ahead are told so, then go back
    tokens = _fragment_tokens(report)
    assert all(t > 0 for per_round in tokens.values() for t in per_round), tokens
    # Back at round 4 the islands train from fragment 1's round start (step 21, offset 3), so fragment 0's round 4
    # holds 3 more steps than H (diloco/fragments.py start_step): trained and folded, not lost.
    whole = 2 * rounds * 6 * PER_STEP
    assert {f: sum(t) for f, t in tokens.items()} == {0: whole + 2 * 3 * PER_STEP, 1: whole}
    assert set(report["islands"].values()) == {report["checksum"]}


def test_an_island_joining_mid_run_is_taken_with_its_weight(tmp_path):
    """An island that joins after round 1 closed starts every fragment at the earliest of their round starts
    (diloco/fragments.py start_step): its first round of fragment 0 holds H + o_1 steps, an honest claim."""
    # robust.first_quorum 1: island 0 trains the first rounds alone, island 1 joining after round 1 closed.
    cfg = _config(2, 1, "rounds.rounds=20", "rounds.min_islands=1", "rounds.heartbeat_s=0.5", "rounds.lease_s=30",
                  "robust.first_quorum=1")
    # Island 0 at 0.1 s a step (0.6 s a round): the run is still going when island 1 is up.
    sim = Simulation(cfg, 2, tmp_path, island_args={0: ["--throttle", "0.1"]})
    try:
        sim.started = time.monotonic()
        sim.start_coordinator()
        sim.start_island(0)
        for summary in sim.watch(300):
            if summary.fragment == 0 and summary.round == 1 and 1 not in sim.island_procs:
                sim.start_island(1)
        report = sim.finish(300).report
    finally:
        sim.close()
    assert report["events"]["refusals"] == {}, report["events"]["refusals"]
    tokens = _fragment_tokens(report)
    assert all(t > 0 for per_round in tokens.values() for t in per_round), tokens
    later = [r for r in report["rounds"] if len(r["islands"]) == 2]
    assert later, "the second island never contributed"
    assert set(report["islands"].values()) == {report["checksum"]}


# --- the same with a token corpus: the ledger names every push's samples --------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _token_config(url: str, tmp_path, *extra: str):
    return _config(2, 1, "data.source=tokens", f"data.url={url!r}", "model.vocab_size=0",
                   f"data.cache_dir={str(tmp_path / 'cache')!r}", "data.shuffle_block=8", *extra)


def _assert_every_fold_named(report: dict, seq_len: int) -> None:
    """Each round's weight is exactly its folded samples' tokens, and no sample is folded twice into a fragment."""
    seen: dict[int, set[int]] = {}
    for r in report["rounds"]:
        positions = [p for a, b in r["data"]["samples"] for p in range(a, b)]
        assert len(positions) * seq_len == r["tokens"] == r["data"]["folded_this_round"], r
        mine = seen.setdefault(r["fragment"], set())
        assert not mine.intersection(positions), f"fragment {r['fragment']} folded a sample twice"
        mine.update(positions)


def test_resumed_islands_and_coordinator_on_tokens_lose_no_fold(corpus, tmp_path):
    """As test_resumed_islands_and_coordinator_lose_no_fold, on a token corpus with the ledger on: every push after the
    resume names samples the ledger leased to it and claims exactly their tokens, so none is refused."""
    cfg = _token_config(corpus, tmp_path, "rounds.rounds=5", "checkpoint.every_rounds=1", "rounds.heartbeat_s=0.5",
                        "rounds.lease_s=8")
    sim = Simulation(cfg, 2, tmp_path, checkpoints=True)
    try:
        sim.start()
        kill_all_and_resume(sim, step=2, islands=2, timeout_s=120)
        for _ in sim.watch(300):
            pass
        report = sim.finish(300).report
    finally:
        sim.close()
    assert report["events"]["restarts"] == 1
    _assert_honest(report, 2, 5)
    _assert_every_fold_named(report, cfg.data.seq_len)
    assert report["data"]["tokens_lost"] == 0, report["data"]


def test_coordinator_restarted_behind_its_islands_on_tokens_claims_what_it_names(corpus, tmp_path):
    """The coordinator alone SIGKILLed rounds after its last checkpoint, on a token corpus: it does not know the leases
    its islands took since. Going back to its rounds, they drop their leases and take new ones, so no push names
    samples it would refuse, every push claims exactly the samples it names, and each replayed round folds both."""
    rounds = 8
    cfg = _token_config(corpus, tmp_path, f"rounds.rounds={rounds}", "checkpoint.every_rounds=4",
                        "rounds.heartbeat_s=0.5", "rounds.lease_s=30")
    report = _coordinator_killed_two_rounds_past_its_checkpoint(cfg, tmp_path)
    refused = report["events"]["refusals"]
    # Before: NOT_LEASED for one fragment of each island, then BAD_REQUEST for the other (a claim of its whole round
    # naming only the samples after the leases were dropped), 25% of the leased tokens lost.
    assert set(refused) <= {"ROUND_AHEAD", "PUSH_AGAIN"}, refused
    tokens = _fragment_tokens(report)
    assert all(len(t) == rounds and all(x > 0 for x in t) for t in tokens.values()), tokens
    _assert_every_fold_named(report, cfg.data.seq_len)
    # What is lost is at most the islands' work in the two rounds the coordinator went back (its folds are gone).
    assert report["data"]["tokens_lost"] <= 2 * 2 * 6 * PER_STEP, report["data"]
    assert set(report["islands"].values()) == {report["checksum"]}


def test_an_island_resumed_behind_the_run_on_tokens_claims_what_it_names(corpus, tmp_path):
    """One island SIGKILLed and resumed from its last checkpoint while the other trains on: it comes back behind the
    coordinator holding leases some of whose samples its earlier self had folded. No push is refused for its claim
    (BAD_REQUEST), every fold names exactly its samples, and no sample is folded twice."""
    cfg = _token_config(corpus, tmp_path, "rounds.rounds=8", "checkpoint.every_rounds=1", "rounds.heartbeat_s=0.5",
                        "rounds.lease_s=8")
    sim = Simulation(cfg, 2, tmp_path, checkpoints=True)
    try:
        sim.start()
        killed = False
        for summary in sim.watch(300):
            if not killed and summary.fragment == 0 and summary.round == 3:
                sim.kill_island(1)
                sim.start_island(1, resume=True)
                killed = True
        report = sim.finish(300).report
    finally:
        sim.close()
    refused = report["events"]["refusals"]
    assert "BAD_REQUEST" not in refused, refused
    _assert_every_fold_named(report, cfg.data.seq_len)
    assert set(report["islands"].values()) == {report["checksum"]}


def _landed(sim: Simulation, island: int, fragment: int) -> int:
    """The round of fragment's last exchange the island landed, from its /metrics (-1 before one, or unreachable)."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{sim.metrics_ports[island]}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return -1
    m = re.search(rf'^diloco_exchange_round\{{fragment="{fragment}"\}} (\S+)$', text, re.M)
    return int(float(m.group(1))) if m else -1


def test_a_coordinator_restarted_between_its_fragments_closes_out_of_order_takes_every_push(corpus, tmp_path):
    """The coordinator SIGKILLed after fragment 1 closed round 4 (past its checkpoint of [4, 4]) and before fragment 0
    did: when it is back, fragment 0's round 4 push (in flight) is taken, fragment 1's round 5 is ahead of it, so the
    islands go back to fragment rounds [5, 4], a whole round apart. They train from fragment 1's round start; fragment
    0's round begins at its own start, as its landing would have begun it. Before: fragment 0's round counted from
    fragment 1's start, claimed more inner steps than a round holds, and was refused BAD_REQUEST and folded on 0 tokens
    (the team run of issue 42, on wikitext-2 over S3)."""
    rounds = 8
    cfg = _token_config(corpus, tmp_path, f"rounds.rounds={rounds}", "checkpoint.every_rounds=1",
                        "rounds.heartbeat_s=0.5", "rounds.lease_s=30")
    # Islands slowed to 1 s an inner step: fragment 0 syncs 2 steps after fragment 1's round 4 lands (tau 1), the
    # window the coordinator is killed in.
    sim = Simulation(cfg, 2, tmp_path, checkpoints=True, island_args={i: ["--throttle", "1.0"] for i in range(2)})
    try:
        sim.start()
        killed = False
        for summary in sim.watch(400):
            if not killed and summary.fragment == 1 and summary.round == 4:
                deadline = time.monotonic() + 120
                while min(_landed(sim, i, 1) for i in range(2)) < 4:
                    assert time.monotonic() < deadline, "the islands never landed fragment 1's round 4"
                    time.sleep(0.05)
                sim.kill_coordinator()
                sim.start_coordinator(resume=True)
                killed = True
        report = sim.finish(400).report
    finally:
        sim.close()
    assert killed
    logs = "".join((tmp_path / f"island-{i}.log").read_text() for i in range(2))
    assert "went back to fragment rounds [5, 4]" in logs, "the kill did not land between the two fragments' closes"
    refused = report["events"]["refusals"]
    assert set(refused) <= {"ROUND_AHEAD", "PUSH_AGAIN"}, refused
    tokens = _fragment_tokens(report)
    assert all(len(t) == rounds and all(x > 0 for x in t) for t in tokens.values()), tokens
    _assert_every_fold_named(report, cfg.data.seq_len)
    assert set(report["islands"].values()) == {report["checksum"]}
