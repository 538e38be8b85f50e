"""The KV pool: buffers carved from one region in whole blocks, freed with their last view."""

from __future__ import annotations

import gc
import resource
import threading

import pytest
import torch

from engine.kv_pool import KVPool

BLOCK = 16 * 32  # a block of 16 tokens of a toy model: 1 layer, 1 head, 4 float32 channels, K and V (32 bytes)


def shape(tokens: int) -> tuple[int, ...]:
    return (1, 2, 1, tokens, 4)


def test_buffers_are_contiguous_disjoint_and_whole_blocks():
    pool = KVPool(8 * BLOCK, BLOCK, prefault=False)
    a = pool.tensor(shape(16), torch.float32)
    b = pool.tensor(shape(20), torch.float32)  # 20 tokens take 2 blocks
    assert a is not None and b is not None
    assert a.shape == shape(16) and a.is_contiguous() and b.is_contiguous()
    assert pool.used_bytes == 3 * BLOCK
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.eq(1.0).all() and b.eq(2.0).all()  # no overlap
    assert abs(b.data_ptr() - a.data_ptr()) >= BLOCK


def test_blocks_come_back_with_the_last_view_not_the_first():
    pool = KVPool(4 * BLOCK, BLOCK, prefault=False)
    kv = pool.tensor(shape(64), torch.float32)
    assert kv is not None and pool.used_bytes == 4 * BLOCK
    head = kv[:, :, :, :16]  # a reader of the leading tokens, as the prefix cache's parts are
    del kv
    gc.collect()
    assert pool.used_bytes == 4 * BLOCK, "a view still reads the blocks"
    assert pool.tensor(shape(16), torch.float32) is None
    del head
    assert pool.used_bytes == 0
    assert pool.tensor(shape(64), torch.float32) is not None


def test_freed_runs_merge_and_the_smallest_fitting_run_is_taken():
    pool = KVPool(6 * BLOCK, BLOCK, prefault=False)
    a, b, c, d = (pool.tensor(shape(16 * n), torch.float32) for n in (1, 2, 1, 2))
    del b  # blocks 1-2 free
    del d  # blocks 4-5 free, and merged with nothing else
    small = pool.tensor(shape(16), torch.float32)  # best fit: either 2-block run, not a 3-block one
    assert small is not None
    del a, c  # blocks 0 and 3 merge with their free neighbours
    big = pool.tensor(shape(16 * 4), torch.float32)
    assert big is not None, "the free runs around the small buffer were merged"
    assert pool.used_bytes == 5 * BLOCK


def test_a_pool_without_a_long_enough_run_misses():
    pool = KVPool(4 * BLOCK, BLOCK, prefault=False)
    keep = [pool.tensor(shape(16), torch.float32) for _ in range(4)]
    keep[0] = keep[2] = None  # two blocks free, apart
    assert pool.used_bytes == 2 * BLOCK
    assert pool.tensor(shape(32), torch.float32) is None
    assert pool.misses == 1
    assert pool.tensor(shape(16), torch.float32) is not None


def test_other_dtypes_view_the_same_blocks():
    pool = KVPool(4 * BLOCK, BLOCK, prefault=False)
    kv = pool.tensor(shape(32), torch.bfloat16)  # half the bytes: one block
    assert kv is not None and kv.dtype == torch.bfloat16 and kv.shape == shape(32)
    assert pool.used_bytes == BLOCK
    kv.copy_(torch.arange(kv.numel(), dtype=torch.bfloat16).view(kv.shape))
    assert kv.flatten()[5].item() == 5.0


def test_buffers_freed_on_other_threads_come_back():
    pool = KVPool(64 * BLOCK, BLOCK, prefault=False)
    buffers = [pool.tensor(shape(16), torch.float32) for _ in range(64)]
    assert all(b is not None for b in buffers)

    def drop(part: list) -> None:
        part.clear()

    halves = [buffers[:32], buffers[32:]]
    buffers.clear()
    threads = [threading.Thread(target=drop, args=(h,)) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.used_bytes == 0
    assert pool.tensor(shape(16 * 64), torch.float32) is not None


@pytest.mark.skipif(not hasattr(resource, "getrusage"), reason="needs getrusage")
def test_a_prefaulted_pool_is_written_without_page_faults():
    pool = KVPool(64 << 20, BLOCK * 64, prefault=True)
    kv = pool.tensor((1, 2, 1, (64 << 20) // 32, 4), torch.float32)
    assert kv is not None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kv.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, f"{faults} page faults writing 64 MiB that were prefaulted (16,384 pages)"
