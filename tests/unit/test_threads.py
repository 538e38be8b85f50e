"""The default thread budget never gives torch and numba more threads than cores (beyond one each),
and the codec's threading layer is TBB where it loads, never OpenMP."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from app.threads import thread_budget, use_codec_layer


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


_LAYER_PROBE = """
import sys
import numba
import numpy as np
from app.threads import use_codec_layer
use_codec_layer(sys.argv[1])
@numba.njit(parallel=True)
def total(x):
    s = 0.0
    for i in numba.prange(x.size):
        s += x[i]
    return s
assert total(np.ones(1000)) == 1000.0
print(numba.threading_layer())
"""


@pytest.mark.parametrize("layer", ["auto", "workqueue"])
def test_the_codec_threading_layer_is_tbb_where_it_loads_and_never_openmp(layer):
    out = subprocess.run(
        [sys.executable, "-c", _LAYER_PROBE, layer], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()[-1]
    # the project installs tbb on x86-64 (pyproject.toml); elsewhere auto falls back to workqueue
    expected = "tbb" if layer == "auto" and platform.machine() == "x86_64" else "workqueue"
    assert out == expected


def test_an_unknown_codec_threading_layer_is_refused():
    with pytest.raises(ValueError, match="omp"):
        use_codec_layer("omp")
