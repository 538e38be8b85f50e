"""Level tables: the shipped one loads and is ordered; bad tables fail with clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

from codec import Level, LevelTableError, Scheme, decode_chunk, encode_chunk, load_level_table
from codec.levels import default_level_table
from codec.quantized import QuantParams
from codec.transformed import TransformParams


def test_default_table_loads_with_lossless_first_and_calibrated_keys() -> None:
    levels = load_level_table(default_level_table())
    assert levels[0].name == "lossless" and levels[0].lossless
    lossy = [lv for lv in levels if not lv.lossless]
    assert [lv.name for lv in lossy][:3] == ["high", "medium", "low"]
    transforms = {lv.quant.transform.id for lv in lossy if isinstance(lv.quant, TransformParams)}
    assert len(lossy) == 3 and len(transforms) == 1  # one calibrated transform for every level


def test_lossy_levels_shrink_in_table_order() -> None:
    levels = load_level_table(default_level_table())
    p = levels[1].quant
    assert isinstance(p, TransformParams)
    layers, heads, dim = p.transform.shape
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(layers, 2, heads, 64, dim, generator=g)
    sizes = [len(encode_chunk(kv, lv, position=256)) for lv in levels]
    assert sizes == sorted(sizes, reverse=True)


def test_narrow_residuals_cost_little() -> None:
    """Residuals that are almost all zero must pick a narrow table (a past bug chose the widest)."""
    kv = torch.randn(2, 2, 2, 256, 16) * 1e-3
    level = Level(
        "coarse", Scheme.QUANT, False, QuantParams(key_step=(50.0,), value_step=(50.0,), exact_tokens=0)
    )
    data = encode_chunk(kv, level)
    assert 8 * len(data) / kv.numel() < 0.6
    assert decode_chunk(data).abs().max() == 0


def _table() -> dict:
    return copy.deepcopy(default_level_table())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.update(format="other"), "format"),
        (lambda t: t.update(levels=[]), "non-empty"),
        (lambda t: t["levels"].reverse(), "first level must be lossless"),
        (lambda t: t["levels"].append(dict(t["levels"][1])), "repeat"),
        (lambda t: t["levels"][1].update(scheme="magic"), "scheme"),
        (lambda t: t["levels"][1].update(key_step=-1), "positive"),
        (lambda t: t["levels"][1].update(key_step=[1.0, 2.0]), "entries"),
        (lambda t: t["levels"][1].update(value_step="big"), "value_step"),
        (lambda t: t["levels"][1].update(groups=0), "groups"),
        (lambda t: t["levels"][1].update(exact_tokens=True), "exact_tokens"),
        (lambda t: t["levels"][1].update(extra=1), "unknown fields"),
        (lambda t: t["levels"][1].update(name="bad name!"), "name"),
        (lambda t: t.update(key_channel_rms=[[1, 2]]), "key_channel_rms"),
        (lambda t: t.update(key_channel_rms=[[[0.0]]]), "key_channel_rms"),
    ],
)
def test_bad_tables_are_rejected_with_a_reason(mutate, message: str) -> None:
    table = _table()
    mutate(table)
    with pytest.raises(LevelTableError, match=message):
        load_level_table(table)


def test_a_table_without_calibration_uses_the_key_spread() -> None:
    table = {
        "format": "cachegen-level-table/1",
        "levels": [
            {"name": "lossless", "scheme": "raw"},
            {"name": "q", "scheme": "quant", "key_step": 0.5, "value_step": 0.5},
        ],
    }
    levels = load_level_table(table)
    assert levels[1].quant is not None and levels[1].quant.key_channel_rms is None
    kv = torch.randn(3, 2, 2, 40, 8)
    assert decode_chunk(encode_chunk(kv, levels[1])).shape == kv.shape
