"""Streaming DiLoCo's fragment layout and schedule, and its config."""

from __future__ import annotations

import pytest

from diloco.config import ConfigError, load_config
from diloco.fragments import layout_for
from diloco.models.llama import Transformer

pytestmark = pytest.mark.unit


def _layout(*overrides: str):
    cfg = load_config(None, ["model.n_layers=6", "inner.steps_per_round=12", *overrides])
    names = [n for n, _ in Transformer(cfg.model).named_parameters()]
    return layout_for(names, cfg), names


def _blocks(fragment) -> list[int]:
    return sorted({int(n.split(".")[1]) for n in fragment.names if n.startswith("blocks.")})


def test_strided_layout_offsets_and_where_the_embedding_and_norm_go():
    layout, names = _layout("streaming.fragments=3")
    assert [_blocks(f) for f in layout] == [[0, 3], [1, 4], [2, 5]]
    assert [f.offset for f in layout] == [0, 4, 8]
    assert "embed.weight" in layout[0].names  # with block 0
    assert "norm.weight" in layout[2].names  # with the last block (5)
    # Every parameter in exactly one fragment, in manifest order within each.
    assert sorted(n for f in layout for n in f.names) == sorted(names)
    for f in layout:
        assert list(f.names) == [n for n in names if n in f.names]


def test_sequential_layout_groups_contiguous_blocks():
    layout, _ = _layout("streaming.fragments=4", "streaming.pattern='sequential'")
    assert [_blocks(f) for f in layout] == [[0, 1], [2, 3], [4], [5]]
    assert "norm.weight" in layout[3].names and "embed.weight" in layout[0].names


def test_schedule_without_streaming_is_plain_diloco():
    layout, names = _layout()
    assert len(layout) == 1 and list(layout[0].names) == names
    assert layout.sync_points(0, 5) == [12, 24, 36, 48, 60]
    assert layout.start_step([3], 5) == 36 and layout.min_spacing() == 12


def test_schedule_with_fragments_staggers_syncs_and_ends_together():
    layout, _ = _layout("streaming.fragments=3")
    assert layout.sync_points(0, 4) == [12, 24, 36, 48]
    assert layout.sync_points(1, 4) == [8, 20, 32, 48]  # offset 4: earlier by 4, the last round ends with the run
    assert layout.sync_points(2, 4) == [4, 16, 28, 48]
    assert layout.min_spacing() == 4
    # Joining while fragments 2 and 1 are in round 2 and fragment 0 still in round 1: train from the earliest start.
    assert layout.start_step([1, 2, 2], 4) == 12


def test_default_digest_is_unchanged_and_streaming_is_part_of_it():
    plain = load_config(None)
    assert plain.streaming.overlap == 0
    assert load_config(None, ["streaming.fragments=1", "streaming.tau=-1"]).digest() == plain.digest()
    assert load_config(None, ["streaming.fragments=2"]).digest() != plain.digest()
    assert load_config(None, ["streaming.fragments=2"]).streaming.overlap == 1  # auto tau with fragments
    assert load_config(None, ["streaming.fragments=2", "streaming.tau=0"]).streaming.overlap == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("streaming.fragments=5", "exceeds model.n_layers"),
        ("streaming.pattern='random'", "streaming.pattern"),
        ("streaming.tau=20", "streaming.tau"),
        ("streaming.alpha=1.0", "streaming.alpha"),
        ("streaming.eager=true", "streaming.eager needs"),
    ],
)
def test_bad_streaming_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
