"""The model-free parts of the calibration command: step allocation, chunked round trips, table output."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app.calibrate import (
    MULTIPLIER_RANGE,
    PROBE_KEY_STEP,
    PROBE_VALUE_STEP,
    format_table,
    layer_factor_args,
    salient_args,
    layer_steps,
    quant_level,
    round_trip_chunks,
)
from codec import load_level_table
from codec.levels import default_level_table


def test_layer_steps_equalise_distortion_within_the_clip() -> None:
    sens = np.array([[1e-3, 1e-3], [4e-3, 1e-3], [2.5e-4, 1e-3]])
    keys, values = layer_steps(sens)
    # step ~ 1/sqrt(sensitivity): 4x the sensitivity, half the step
    assert np.isclose(keys[1] / keys[0], 0.5) and np.isclose(keys[2] / keys[0], 2.0)
    assert np.allclose(values / PROBE_VALUE_STEP, values[0] / PROBE_VALUE_STEP)
    extreme = layer_steps(np.array([[1e-9, 1.0], [1.0, 1.0]]))[0] / PROBE_KEY_STEP
    assert extreme.max() <= MULTIPLIER_RANGE[1] and extreme.min() >= MULTIPLIER_RANGE[0]


def test_round_trip_chunks_counts_every_byte_and_keeps_the_shape() -> None:
    rms = np.ones((2, 2, 8))
    level = quant_level("t", [0.5, 1.0], [0.5], rms)
    kv = torch.randn(2, 2, 2, 300, 8)
    out, size = round_trip_chunks(kv, level, chunk_tokens=128)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    assert size > 0 and (out - kv).abs().max() < 1.0


def test_written_table_is_compact_json_that_loads() -> None:
    table = default_level_table()
    text = format_table(table)
    assert json.loads(text) == table
    assert len(text.splitlines()) < 400  # one line per layer row, not per number
    assert load_level_table(json.loads(text))[0].name == "lossless"


def test_finer_layer_arguments_parse_and_refuse_what_they_cannot_mean() -> None:
    assert layer_factor_args(["4=0.5", "11=0.75"]) == {"*": {4: 0.5, 11: 0.75}}
    assert layer_factor_args(["4=0.6", "low:2=0.5", "low:4=0.9"]) == {"*": {4: 0.6}, "low": {2: 0.5, 4: 0.9}}
    assert layer_factor_args([]) == {}
    for bad in ["4", "4=", "x=0.5", "-1=0.5", "4=0", "4=-1", "4=5", "4=nan", "low:", "low:x=1"]:
        with pytest.raises(ValueError, match="--finer-layer"):
            layer_factor_args([bad])


def test_salient_arguments_parse_and_refuse_what_they_cannot_mean() -> None:
    assert salient_args(["0.05:0.4"]) == {"*": (0.05, 0.4)}
    assert salient_args(["low=0.05:0.4", "medium=0.03:0.5"]) == {"low": (0.05, 0.4), "medium": (0.03, 0.5)}
    for bad in ["0.05", "low=0.05", "low=x:0.4", "low=0:0.4", "low=0.05:1", "low=0.05:1e-9", "low=1:0.4"]:
        with pytest.raises(ValueError, match="--salient"):
            salient_args([bad])

