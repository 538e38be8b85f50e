"""benchmarks/kv_balance.py's variants and the pass-key answer's NLL, on the real default model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from app.calibrate import round_trip_chunks
from benchmarks.kv_balance import KEYS_ONLY, VALUES_ONLY, decoded, scaled
from codec.levels import level_by_name
from engine import ModelRunner, load_model
from engine.quality import passkey_answer_nll, passkey_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir)))


@pytest.fixture(scope="module")
def task(runner):
    return passkey_task(runner, 400, seed=3)


@pytest.fixture(scope="module")
def kv(runner, task) -> torch.Tensor:
    return runner.compute_kv(task.context_ids)


def test_the_answer_nll_prefers_the_hidden_key_to_another(runner, task, kv):
    # read at the wrong positions (one token off), the NLL would not tell the two keys apart
    wrong = dataclasses.replace(task, answer=str(int(task.answer) % 90000 + 10001))
    right_nll, wrong_nll = passkey_answer_nll(runner, task, kv), passkey_answer_nll(runner, wrong, kv)
    assert right_nll < wrong_nll - 2.0, (right_nll, wrong_nll)


def test_a_one_sided_variant_keeps_the_other_side_exact(kv):
    level = level_by_name("medium")
    full, size = round_trip_chunks(kv, level)
    cache: dict = {}
    for variant, coded_side in ((KEYS_ONLY, 0), (VALUES_ONLY, 1)):
        out, bits = decoded(kv, level, variant, cache)
        assert torch.equal(out[:, 1 - coded_side], kv[:, 1 - coded_side])
        assert torch.equal(out[:, coded_side], full[:, coded_side].to(kv.dtype))
        assert bits == 8.0 * size / kv.numel()
    assert not torch.equal(full.to(kv.dtype), kv)  # the level is lossy: the sides differ from it


def test_scaled_steps_move_the_size_and_unit_scales_change_nothing(kv):
    level = level_by_name("medium")
    _, size = round_trip_chunks(kv, level)
    _, same = round_trip_chunks(kv, scaled(level, 1.0, 1.0))
    _, coarser_keys = round_trip_chunks(kv, scaled(level, 2.0, 1.0))
    _, coarser_values = round_trip_chunks(kv, scaled(level, 1.0, 2.0))
    assert same == size
    assert coarser_keys < size and coarser_values < size
