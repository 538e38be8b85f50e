"""The transform's matmul split over the codec's threads gives the bits of one bmm."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numba
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
