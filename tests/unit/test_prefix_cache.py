"""The in-memory prefix cache of computed KV (scheduler/prefix_cache.py), on small tensors."""

from __future__ import annotations

import torch

from scheduler.kv_memory import KVMemory
from scheduler.prefix import chain_root, make_fingerprint
from scheduler.prefix_cache import BLOCK_TOKENS, PrefixCache
from scheduler.tenancy import PUBLIC, KeySpace

FP = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=256)
A = KeySpace(salt=b"tenant-a", tenant="a")
B = KeySpace(salt=b"tenant-b", tenant="b")


def cache() -> PrefixCache:
    return PrefixCache(lambda space: chain_root(FP, space.salt))


def buffer(tokens: int, fill: float = 0.0) -> torch.Tensor:
    kv = torch.zeros(2, 2, 1, tokens, 4)
    kv[:, :, :, :, 0] = torch.arange(tokens, dtype=torch.float32) + fill
    return kv


def finished(c: PrefixCache, ids: list[int], space=PUBLIC, capacity: int | None = None, nbytes: int = 100):
    """A request that prefilled ``ids`` and finished: published at prefill, released at the end."""
    run = c.publish(buffer(capacity or len(ids)), ids, nbytes, space)
    assert c.release(run, ids, space) == 0
    return run


def test_hits_are_whole_blocks_of_the_longest_prefix():
    c = cache()
    ids = list(range(100))
    finished(c, ids)
    hit = c.lookup(ids + [7, 7, 7], PUBLIC)
    assert hit is not None and hit.tokens == 96  # 6 full blocks of 16
    c.unpin(hit)
    hit = c.lookup(ids[:40] + [999] * 30, PUBLIC)
    assert hit.tokens == 32  # the divergence in block 2 ends it
    c.unpin(hit)
    assert c.lookup([999] + ids[1:], PUBLIC) is None  # keys chain: a different first token misses all


def test_another_tenant_or_salt_never_hits():
    c = cache()
    ids = list(range(64))
    finished(c, ids, A)
    assert c.lookup(ids, B) is None
    assert c.lookup(ids, PUBLIC) is None
    hit = c.lookup(ids, A)
    assert hit is not None and hit.tokens == 64


def test_a_lossy_run_serves_only_requests_that_accept_its_loss():
    c = cache()
    ids = list(range(64))
    run = c.publish(buffer(64), ids, 100, PUBLIC, distortion=0.05)
    c.release(run, ids, PUBLIC)
    assert c.lookup(ids, PUBLIC, max_distortion=0.0) is None  # lossless asked: no
    hit = c.lookup(ids, PUBLIC, max_distortion=0.1)
    assert hit is not None and hit.run is run


def test_take_hands_over_an_idle_buffer_and_keeps_only_the_hit_blocks():
    c = cache()
    ids = list(range(80))
    run = finished(c, ids, capacity=200)
    question = ids[:48] + [500] * 20
    hit = c.lookup(question, PUBLIC)
    assert hit.tokens == 48
    taken = c.take(hit, capacity=150)
    assert taken is run and run.owned and len(run.keys) == 3
    assert c.lookup(ids, PUBLIC).tokens == 48  # the blocks after the hit are gone: they will be overwritten
    # nothing can evict a buffer a request owns
    assert c.reclaim(10**9) == 0


def test_take_refuses_a_buffer_too_small_or_in_use():
    c = cache()
    ids = list(range(64))
    finished(c, ids, capacity=64)
    hit = c.lookup(ids, PUBLIC)
    assert c.take(hit, capacity=65) is None  # too small: the request copies instead
    other = c.lookup(ids, PUBLIC)  # a second reader pins it too
    assert c.take(hit, capacity=10) is None
    c.unpin(hit)
    c.unpin(other)
    owned = c.publish(buffer(64), list(range(1000, 1064)), 100, PUBLIC)  # still generating
    hit = c.lookup(list(range(1000, 1064)), PUBLIC)
    assert hit.run is owned and c.take(hit, capacity=10) is None


def test_release_extends_with_generated_tokens_and_drops_what_adds_nothing():
    c = cache()
    prompt = list(range(40))
    run = c.publish(buffer(100), prompt, 100, PUBLIC)
    assert c.lookup(prompt, PUBLIC).tokens == 32
    c.unpin(c.lookup(prompt, PUBLIC))
    turn = prompt + list(range(200, 230))  # the reply the next chat turn starts with
    assert c.release(run, turn, PUBLIC) == 0
    hit = c.lookup(turn + [1, 2, 3], PUBLIC)
    assert hit.tokens == 64
    c.unpin(hit)
    # the same prompt again adds no block: its buffer goes back at once
    again = c.publish(buffer(100), prompt, 77, PUBLIC)
    assert c.release(again, prompt, PUBLIC) == 77
    # a failed request's buffer is never kept
    failed = c.publish(buffer(100), list(range(300, 340)), 55, PUBLIC)
    assert c.release(failed, None, PUBLIC) == 55
    assert c.lookup(list(range(300, 340)), PUBLIC) is None


def test_reclaim_evicts_least_recently_used_unpinned_runs():
    c = cache()
    first = finished(c, list(range(32)), nbytes=10)
    finished(c, list(range(100, 132)), nbytes=10)
    c.unpin(c.lookup(list(range(32)), PUBLIC))  # first is now the most recent
    pinned = c.lookup(list(range(32)), PUBLIC)
    assert c.reclaim(5) == 10  # the second goes: least recent
    assert c.lookup(list(range(100, 132)), PUBLIC) is None
    assert c.reclaim(5) == 0  # the first is pinned
    c.unpin(pinned)
    assert c.reclaim(5) == 10 and c.lookup(list(range(32)), PUBLIC) is None
    assert first.tokens == 32 and c.stats.evicted_runs == 2


def test_memory_reclaims_cached_buffers_before_a_reservation_waits():
    c = cache()
    memory = KVMemory(100, reclaim=c.reclaim)
    assert memory.reserve(60)
    run = c.publish(buffer(32), list(range(32)), 60, PUBLIC)
    assert c.release(run, list(range(32)), PUBLIC) == 0  # the cache keeps the 60 bytes
    assert memory.used == 60 and c.cached_bytes == 60
    assert memory.reserve(70)  # does not fit beside the cached run: it is evicted, no wait
    assert memory.used == 70 and c.cached_bytes == 0


def test_block_keys_are_those_of_16_token_blocks():
    c = cache()
    assert len(c.block_keys(list(range(BLOCK_TOKENS * 3 + 5)), PUBLIC)) == 3


def test_kv_loaded_from_a_deleted_or_expired_context_is_not_served():
    c = cache()
    ids = list(range(64))
    run = c.publish(buffer(64), ids, 40, PUBLIC, store_key="k" * 64)
    c.release(run, ids, PUBLIC)
    assert c.forget("k" * 64) == 40  # unused: dropped now, its bytes to release
    assert c.lookup(ids, PUBLIC) is None
    busy = c.publish(buffer(64), ids, 40, PUBLIC, store_key="k" * 64)
    assert c.forget("k" * 64) == 0  # in use: not served, dropped when its request ends
    assert c.lookup(ids, PUBLIC) is None
    assert c.release(busy, ids, PUBLIC) == 40
    expiring = c.publish(buffer(64), ids, 40, PUBLIC, expires=0.5)  # long past
    assert c.lookup(ids, PUBLIC) is None
    assert c.release(expiring, ids, PUBLIC) == 40


def share(c: PrefixCache, hit, ids: list[int], nbytes: int, space=PUBLIC):
    """A request that attached ``hit`` and prefilled the rest of ``ids`` into a buffer of its own."""
    own = buffer(len(ids) - hit.tokens, fill=1000.0)
    return c.publish(own, ids, nbytes, space, parent=hit)


def test_a_request_on_a_run_in_use_shares_it_and_its_run_continues_the_parent():
    c = cache()
    context = list(range(100))
    first = c.publish(buffer(120), context + [7] * 20, 100, PUBLIC)  # still generating
    question = context[:96] + [500] * 40
    hit = c.lookup(question, PUBLIC)
    assert hit.run is first and hit.tokens == 96 and c.take(hit, capacity=200) is None
    [view] = hit.parts()
    assert view.data_ptr() == first.kv.data_ptr() and view.shape[3] == 96  # the parent's memory
    child = share(c, hit, question, nbytes=30)
    assert child.parent is first and child.offset == 96 and first.pins == 2  # the request's, the run's
    # a hit past the parent's tokens attaches both buffers, in order
    deeper = c.lookup(question + [1] * 3, PUBLIC)
    assert deeper.run is child and deeper.tokens == 128
    head, tail = deeper.parts()
    assert head.data_ptr() == first.kv.data_ptr() and head.shape[3] == 96
    assert tail.data_ptr() == child.kv.data_ptr() and tail.shape[3] == 32
    assert torch.equal(tail[0, 0, 0, :, 0], torch.arange(32) + 1000.0)
    # a hit within the parent's tokens is the parent's
    assert c.lookup(context[:64], PUBLIC).run is first
    assert c.take(deeper, capacity=140) is None  # still its request's


def shared_finished_parent(c: PrefixCache, ids: list[int], question: list[int]):
    """A finished run of ``ids`` (100 bytes), and a request on ``ids + question`` sharing it (30)."""
    parent = finished(c, ids, nbytes=100)
    hit = c.lookup(ids + question, PUBLIC)
    return parent, hit, share(c, hit, ids + question, nbytes=30)


def test_a_parent_outlives_its_readers_and_children():
    c = cache()
    ids = list(range(64))
    parent, hit, child = shared_finished_parent(c, ids, [9] * 20)
    assert c.release(child, ids + [9] * 20, PUBLIC) == 0  # kept: it adds a block
    assert c.unpin(hit) == 0  # the request is done; the child still pins its parent
    assert parent.pins == 1
    # eviction takes the child first, then the parent it no longer pins
    assert c.reclaim(120) == 130 and c.lookup(ids, PUBLIC) is None and c.stats.evicted_runs == 2


def test_a_run_dropped_while_read_is_freed_by_its_last_reader():
    c = cache()
    ids = list(range(64))
    run = c.publish(buffer(64), ids, 40, PUBLIC, store_key="k" * 64)
    reader = c.lookup(ids + [5] * 30, PUBLIC)  # a request attaches it while its owner still runs
    assert c.release(run, ids, PUBLIC) == 0
    assert c.forget("k" * 64) == 0  # deleted while read: unlisted, not freed
    assert c.lookup(ids, PUBLIC) is None
    assert c.reclaim(10**9) == 0  # never under a reader
    assert c.unpin(reader) == 40  # the last reader frees it
    assert c.cached_bytes == 0


def test_a_failed_child_gives_back_its_own_buffer_and_its_pin():
    c = cache()
    ids = list(range(48))
    parent, hit, child = shared_finished_parent(c, ids, [3] * 16)
    assert c.release(child, None, PUBLIC) == 30  # a failed request: never kept
    assert c.unpin(hit) == 0 and parent.pins == 0
    assert c.lookup(ids + [3] * 16, PUBLIC).run is parent
