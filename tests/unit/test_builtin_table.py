"""Which level table a gateway serves when none is configured (app.gateway.builtin_table)."""

from __future__ import annotations

import pytest

from app.gateway import builtin_table
from codec.levels import V4_TABLE_FILE, default_level_table, shipped_level_table
from codec.transform import cheap_inverse
from scheduler.geometry import KVGeometry

DEFAULT_MODEL = KVGeometry(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M's KV
TRANSFORM, V4 = default_level_table(), shipped_level_table(V4_TABLE_FILE)


def test_a_gpu_serves_the_transform_levels() -> None:
    assert builtin_table("cuda", DEFAULT_MODEL) == TRANSFORM


def test_a_cpu_serves_them_where_their_inverse_is_cheap() -> None:
    assert builtin_table("cpu", DEFAULT_MODEL) == (TRANSFORM if cheap_inverse("cpu") else V4)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("geometry", [KVGeometry(30, 3, 32), KVGeometry(12, 3, 64), KVGeometry(30, 4, 64)])
def test_a_model_the_transform_does_not_fit_gets_format_4(device: str, geometry: KVGeometry) -> None:
    """The default model's transform cannot code another shape of KV; format 4's levels code any."""
    assert builtin_table(device, geometry) == V4


def test_other_devices_get_format_4() -> None:
    assert builtin_table("mps", DEFAULT_MODEL) == V4
