"""The transform's matmul split over the codec's threads gives the bits of one bmm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import pytest
import torch

from codec import split_matmul

needs_two = pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one core")


def on_a_codec_thread(fn, numba_threads: int):
    """Run ``fn`` on a fresh thread set up as the gateway's codec threads are: one torch thread."""

    def run():
        torch.set_num_threads(1)
        numba.set_num_threads(numba_threads)
        return fn()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


@needs_two
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("groups", [1, 3, 60])
def test_split_bmm_is_one_bmm(dtype, groups):
    g = torch.Generator().manual_seed(groups)
    a = torch.randn(groups, 255, 192, generator=g).to(dtype)
    b = torch.randn(groups, 192, 192, generator=g).to(dtype)
    expected = on_a_codec_thread(lambda: torch.bmm(a, b), 1)
    assert on_a_codec_thread(lambda: split_matmul.lanes(groups, a.device), 2) == min(2, groups)
    got = on_a_codec_thread(lambda: split_matmul.bmm(a, b, torch.empty_like(expected)), 2)
    assert torch.equal(got, expected)


@needs_two
def test_one_lane_where_torch_has_its_own_threads():
    def lanes():
        torch.set_num_threads(2)
        return split_matmul.lanes(60, torch.device("cpu"))

    assert on_a_codec_thread(lanes, 2) == 1
    assert on_a_codec_thread(lambda: split_matmul.lanes(60, torch.device("cpu")), 1) == 1
    assert on_a_codec_thread(lambda: split_matmul.lanes(60, torch.device("meta")), 2) == 1


@needs_two
def test_the_inverse_on_split_lanes_is_the_one_lane_inverse():
    """The bf16 inverse as the gateway's codec threads run it (its copy and matmul split in two)
    gives the bits of the inverse on one lane, into a slice of a larger buffer as the loader's."""
    from codec.transform import RowScale, fit_transform

    layers, heads, dim, tokens = 3, 2, 16, 40
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(layers, 2, heads, 300, dim, generator=g)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)).numpy()
    t = fit_transform(kv, torch.ones(layers, heads, dim).numpy(), inv_freq=inv_freq, model="m")
    coefficients = torch.randn(layers, 2, heads, tokens, dim, generator=g)

    # salient rows in layers 0 and 2: with three layers in two lanes, each lane scales its own
    scale = RowScale(np.array([0, 0, 2]), np.array([1, 39, 7]), 0.25)

    def inverse(numba_threads: int, rows: RowScale | None) -> torch.Tensor:
        buffer = torch.zeros(layers, 2, heads, tokens + 5, dim)
        buffer[:, :, :, 5:] = coefficients

        def run():
            assert split_matmul.lanes(layers * 2, buffer.device) == numba_threads
            t.inverse_(buffer[:, :, :, 5:], 300, bf16=True, scale=rows)
            return buffer

        return on_a_codec_thread(run, numba_threads)

    one, two = inverse(1, None), inverse(2, None)
    assert torch.equal(two, one) and not torch.equal(two[:, :, :, 5:], coefficients)
    # the rows scaled by the lanes: the bits of scaling them all first, then the one-lane inverse
    original = coefficients
    coefficients = original.clone()
    coefficients[scale.layer, :, :, scale.token, :] *= scale.ratio
    before = inverse(1, None)
    coefficients = original
    for numba_threads in (1, 2):
        assert torch.equal(inverse(numba_threads, scale), before)
    assert not torch.equal(inverse(2, None), before)  # the rows matter
