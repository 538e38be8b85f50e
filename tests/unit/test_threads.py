"""The default thread budget never gives torch and numba more threads than cores (beyond one each)."""

from __future__ import annotations

import pytest

from app.threads import thread_budget


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 16, 64])
def test_defaults_split_the_cores(cores):
    budget = thread_budget(None, None, cores)
    assert budget.torch >= 1 and budget.numba >= 1
    assert budget.torch + budget.numba <= max(cores, 2)


def test_settings_win():
    assert thread_budget(2, None, 2).torch == 2
    assert thread_budget(None, 2, 16).numba == 2
    assert thread_budget(None, 2, 16).torch == 14
    assert thread_budget(1, None, 16).torch_alone == 1  # a setting fixes torch's threads


def test_torch_may_use_every_core_while_the_codec_is_idle():
    assert thread_budget(None, None, 2).torch_alone == 2


def test_the_codec_may_use_every_core_while_the_model_is_idle():
    assert thread_budget(None, None, 2).numba_alone == 2
    assert thread_budget(None, None, 16).numba_alone == 16
    assert thread_budget(None, 1, 16).numba_alone == 1  # a setting fixes numba's threads
