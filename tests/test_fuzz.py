"""Fuzzing (issue 15, item 5): random and mutated requests, push streams, bytes, metadata and deadlines at
every RPC, from a client made from the .proto alone, beside a legitimate two-island run over mutual TLS
(tests/probes/fuzz.py). Every answer is explained, the coordinator serves on, and the run ends where it
would have ended undisturbed."""

from __future__ import annotations

import pytest

from conftest import tiny_config
from tests.probes import fuzz

pytestmark = pytest.mark.integration

# Answers only a push that got as far as its chunks can get (or one the coordinator accepted).
DEEP = {"-", "BAD_CHUNK", "CORRUPT_CHUNK", "NOT_FINITE", "DUPLICATE"}


def test_fuzzing_every_rpc_beside_a_run_gets_explained_answers_and_leaves_its_aggregate_as_it_was(tmp_path):
    # The tiny run with the robust defaults (tiny_config turns the claim check off for the protocol tests).
    cfg = tiny_config("rounds.rounds=20", *fuzz.RUN)
    report = fuzz.fuzz(cfg, tmp_path, seed=0, calls=1500, seconds=20.0)
    assert report.ok, f"{report.summary()}\n{report.table()}"
    # It reached every RPC of the .proto, and pushes got as far as their chunks.
    assert {rpc for rpc, _, _ in report.tally} == {m.name for m in fuzz.SERVICE.methods}, report.table()
    assert DEEP & {label for rpc, _, label in report.tally if rpc == "PushPseudoGradient"}, report.table()
    assert ("UNKNOWN" not in {code for _, code, _ in report.tally}), report.table()
