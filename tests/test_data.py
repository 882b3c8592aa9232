from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diloco.config import ConfigError, DataConfig
from diloco.data.sources import MarkovLanguage, eval_batches, train_stream

pytestmark = pytest.mark.unit

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def test_entropy_rate_matches_empirical_estimate():
    lang = MarkovLanguage.build(vocab=16, order=2, branching=3, seed=1)
    seqs = lang.sample(np.random.default_rng(0), batch=64, length=2000)
    # Empirical conditional entropy of the next token given the previous two.
    counts: dict[tuple[int, int], np.ndarray] = {}
    for row in seqs:
        for a, b, c in zip(row[:-2], row[1:-1], row[2:]):
            counts.setdefault((a, b), np.zeros(16))[c] += 1
    total = sum(v.sum() for v in counts.values())
    h = -sum((v[v > 0] / total * np.log(v[v > 0] / v.sum())).sum() for v in counts.values())
    assert abs(h - lang.entropy_rate()) < 0.02
    assert 0 < lang.entropy_rate() < math.log(3)


def test_synthetic_shards_differ_and_streams_resume_exactly():
    cfg = DataConfig()
    a, b = train_stream(cfg, 0, 0, 2), train_stream(cfg, 0, 1, 2)
    assert not torch.equal(a.next_batch(4)[0], b.next_batch(4)[0])
    state = a.state_dict()
    first = a.next_batch(4)
    a.load_state_dict(state)
    assert torch.equal(a.next_batch(4)[0], first[0])


def test_targets_are_inputs_shifted_by_one():
    x, y = train_stream(DataConfig(), 0, 0, 1).next_batch(2)
    assert torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs ../shared/data")
@pytest.mark.parametrize("stripe", [0, 4096])
def test_text_shards_are_disjoint_and_eval_is_held_out(stripe):
    cfg = DataConfig(source="text", path=str(SHAKESPEARE), seq_len=64, stripe_bytes=stripe)
    streams = [train_stream(cfg, 0, s, 4) for s in range(4)]
    raw = SHAKESPEARE.read_bytes()
    train = raw[: int(len(raw) * 0.9)]
    # Every shard's stripes are distinct pieces of the training text, and no piece is in two shards.
    pieces = [bytes(row.tolist()) for s in streams for row in s.tokens]
    assert len(set(pieces)) == len(pieces)
    offsets = [train.find(p) for p in pieces]
    assert all(o >= 0 and o % len(pieces[0]) == 0 for o in offsets)
    if stripe:
        assert len(pieces[0]) == stripe and sorted(offsets)[:8] == [i * stripe for i in range(8)]  # interleaved
    else:
        assert len(pieces) == 4  # one contiguous block each
    # Windows come from inside the shard's own stripes.
    inputs, targets = streams[1].next_batch(16)
    own = b"".join(bytes(row.tolist()) for row in streams[1].tokens)
    assert all(bytes(seq.tolist()) in own for seq in inputs)
    held_out = raw[int(len(raw) * 0.9):]
    batch = eval_batches(cfg, 2, 4)[0][0]
    assert bytes(batch[0].tolist()) in held_out
    assert eval_batches(cfg, 2, 4)[1][0].equal(eval_batches(cfg, 2, 4)[1][0])


def test_missing_text_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="data file not found"):
        train_stream(DataConfig(source="text", path=str(tmp_path / "none.txt")), 0, 0, 1)
