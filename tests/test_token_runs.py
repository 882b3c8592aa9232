"""Runs on a token corpus: leases from the coordinator, every sample folded at most once, the account."""

from __future__ import annotations


import pytest

from conftest import island_on, tiny_config
from kit import write_corpus
from diloco.config import ConfigError
from diloco.data.shards import read_manifest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def token_config(url: str, tmp_path, *overrides: str):
    return tiny_config("data.source=tokens", f"data.url={url!r}", "model.vocab_size=0", f"data.cache_dir={str(tmp_path / 'cache')!r}",
                       "data.shuffle_block=8", *overrides)


def _positions(ranges) -> list[int]:
    return [p for a, b in ranges for p in range(a, b)]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_an_island_trains_every_leased_sample_once_and_the_account_adds_up(where, corpus, tmp_path, make_coordinator, request):
    if where == "s3":  # prepared into a real S3 API (moto on 127.0.0.1), streamed from there by both sides
        corpus = write_corpus(tmp_path, docs=200, url=f"{request.getfixturevalue('s3')}/tokens")
    cfg = token_config(corpus, tmp_path, "rounds.rounds=3", "inner.steps_per_round=3", "eval.batches=2",
                       "robust.first_quorum=1")  # one island
    coordinator = make_coordinator(cfg)
    assert cfg.model.vocab_size == read_manifest(corpus)[0].vocab_size > 256  # resolved from the corpus's manifest
    with island_on(coordinator, cfg) as island:
        result = island.run()
    assert result.rounds == 3 and result.checksum_matches
    assert coordinator.wait(120), "the coordinator did not record the last round"  # its eval may lag the island's leave
    report = coordinator.report()
    seq, per_round = cfg.data.seq_len, cfg.inner.steps_per_round * cfg.inner.batch_size
    folded: list[int] = []
    for r in report["rounds"]:
        data = r["data"]
        # The aggregate's tokens are exactly the tokens of the positions folded, and no position twice.
        assert data["folded_this_round"] == r["tokens"] == per_round * seq
        folded += _positions(data["samples"])
    assert len(folded) == len(set(folded)) == 3 * per_round, [r["data"] for r in report["rounds"]]
    d = report["data"]
    assert d["tokens_trained"] == 3 * per_round * seq and d["tokens_repeated"] == 0 and d["tokens_lost"] == 0
    # One lease a round, all of it trained: nothing to hand back, nothing held after the island left.
    assert d["tokens_leased"] == d["tokens_trained"] + d["tokens_returned"] and d["fragments"][0]["held"] == 0
    assert report["rounds"][-1]["eval_loss"] < report["initial_eval_loss"]


def test_a_model_whose_vocabulary_is_not_the_corpus_is_refused_at_start(corpus, tmp_path, make_coordinator):
    with pytest.raises(ConfigError, match="vocabulary of .* the model 64"):
        make_coordinator(token_config(corpus, tmp_path, "model.vocab_size=64"))


def _sim_token_config(url: str, tmp_path, rounds: int, islands: int, *extra: str):
    return token_config(
        url, tmp_path, f"rounds.rounds={rounds}", f"rounds.min_islands={islands}", "inner.steps_per_round=4",
        "inner.lr=1e-2", "inner.warmup_steps=2", "eval.batches=4", "checkpoint.every_rounds=1", "rounds.heartbeat_s=0.5",
        "rounds.lease_s=8", *extra,
    )


def check_exactly_once(report: dict, seq_len: int) -> dict:
    """Every round's tokens are its folded positions' tokens; no position folded twice; the account adds up."""
    folded: list[int] = []
    for r in report["rounds"]:
        assert r["data"]["folded_this_round"] == r["tokens"] > 0, r
        positions = _positions(r["data"]["samples"])
        assert len(positions) * seq_len == r["tokens"]
        folded += positions
    assert len(folded) == len(set(folded)), "a sample position was folded twice"
    d = report["data"]
    assert d["tokens_trained"] == len(folded) * seq_len and d["tokens_repeated"] == 0
    assert d["tokens_leased"] == d["tokens_trained"] + d["tokens_returned"] + d["tokens_lost"] + d["fragments"][0]["held"]
    return d


def test_a_stopped_and_resumed_run_on_tokens_ends_bit_identical(corpus, tmp_path):
    from conftest import straight_and_resumed

    cfg = _sim_token_config(corpus, tmp_path, 5, 2)
    straight, resumed = straight_and_resumed(cfg, 2, tmp_path, step=2)
    assert resumed.report["events"]["restarts"] == 1
    # The same islands trained on the same samples: the data cursors and leases came back exactly.
    assert resumed.report["checksum"] == straight.report["checksum"]
    assert [r["data"]["samples"] for r in resumed.report["rounds"]] == [r["data"]["samples"] for r in straight.report["rounds"]]
    check_exactly_once(resumed.report, cfg.data.seq_len)


def test_a_chaos_run_on_tokens_folds_every_sample_at_most_once_and_accounts_for_the_rest(corpus, tmp_path):
    from islands.sim.chaos import ChaosPlan, run_chaos
    from islands.sim.simulation import summarize

    # Short leases run out while an island or the coordinator is down: islands come back as themselves,
    # after leases were granted ahead of them. (min_islands stays at every island: with fewer, the run
    # could end while a killed island restarts, and it would find no coordinator.)
    rounds, islands = 10, 3
    cfg = _sim_token_config(corpus, tmp_path, rounds, islands, "inner.steps_per_round=40", "rounds.lease_s=3")
    result, chaos = run_chaos(cfg, islands, tmp_path / "chaos",
                              ChaosPlan(island_every=3, coordinator_at=3, seed=2, kill_delay_s=(0.0, 0.05)),
                              timeout_s=400, echo=lambda s: None)
    report = result.report
    who = [k[0] for k in chaos.kills]
    assert "coordinator" in who and sum(w.startswith("island") for w in who) >= 1, who
    assert [r["round"] for r in report["rounds"]] == list(range(rounds))
    assert set(report["islands"].values()) == {report["checksum"]}
    d = check_exactly_once(report, cfg.data.seq_len)
    assert d["fragments"][0]["held"] == 0  # every island left: nothing is still out
    lines: list[str] = []
    summarize(result, cfg, echo=lines.append)
    assert (f"token corpus: {d['tokens_trained']:,} tokens trained, {d['tokens_lost']:,} lost with discarded rounds, "
            f"{d['tokens_returned']:,} leased and handed back untrained, 0 trained twice") in lines, lines


def test_a_corrupt_shard_stops_the_island_with_one_line_naming_it(tmp_path, make_coordinator):
    from diloco.data.shards import DataError

    url = write_corpus(tmp_path, docs=150)
    cfg = token_config(url, tmp_path, "rounds.rounds=2")
    coordinator = make_coordinator(cfg)  # it reads the manifest and the eval split only
    shards = sorted((tmp_path / "tokens" / "train").glob("shard-*.bin"))
    for shard in shards:  # every one: whichever the island reads first is found out
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    with island_on(coordinator, cfg) as island, pytest.raises(DataError) as e:
        island.run()
    message = str(e.value)
    assert any(f"train/{s.name}" in message for s in shards) and "\n" not in message and "checksum" in message, message
