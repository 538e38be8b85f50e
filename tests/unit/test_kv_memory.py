"""The KV memory budget: reservations wait their turn, cancel cleanly, and never exceed the budget."""

from __future__ import annotations

import threading
import time

import pytest

from scheduler.flag import Flag
from scheduler.kv_memory import KVMemory, KVMemoryExceeded


def test_reservations_within_the_budget_do_not_wait():
    memory = KVMemory(100)
    assert memory.reserve(60)
    assert memory.reserve(40)
    assert memory.used == 100
    memory.release(100)
    assert memory.used == 0


def test_more_than_the_whole_budget_is_refused_at_once():
    with pytest.raises(KVMemoryExceeded, match="CACHEGEN_KV_MEMORY_BYTES"):
        KVMemory(100).reserve(101)


def test_a_reservation_waits_for_a_release():
    memory = KVMemory(100)
    memory.reserve(80)
    got = threading.Event()
    threading.Thread(target=lambda: memory.reserve(50) and got.set(), daemon=True).start()
    assert not got.wait(0.2)
    memory.release(80)
    assert got.wait(5)
    assert memory.used == 50


def test_waiters_are_served_first_come_first_served():
    memory = KVMemory(100)
    memory.reserve(100)
    order: list[str] = []
    big = memory.reserve_async(90)
    big.add_done_callback(lambda _: order.append("big"))
    small = memory.reserve_async(10)
    small.add_done_callback(lambda _: order.append("small"))
    assert memory.waiting == 2
    memory.release(20)  # the small one would fit now, but the big one came first
    assert order == [] and memory.used == 80
    memory.release(80)
    assert order == ["big", "small"] and memory.used == 100


def test_a_cancelled_reservation_holds_nothing_and_unblocks_the_queue():
    memory = KVMemory(100)
    memory.reserve(100)
    cancel = Flag()
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(memory.reserve(60, cancel)), daemon=True)
    waiter.start()
    while memory.waiting < 1:
        time.sleep(0.01)
    cancel.set()
    waiter.join(5)
    assert result == [False]
    assert memory.waiting == 0 and memory.used == 100


def test_try_reserve_takes_only_what_fits_now_and_never_jumps_the_queue():
    memory = KVMemory(100)
    assert memory.try_reserve(70) and not memory.try_reserve(40) and memory.used == 70
    waiter = threading.Thread(target=memory.reserve, args=(50,))
    waiter.start()
    while not memory.waiting:
        time.sleep(0.01)
    assert not memory.try_reserve(10)  # it would fit, but a reservation waits first
    memory.release(70)
    waiter.join(5)
    assert memory.used == 50 and memory.try_reserve(50) and memory.used == 100


def test_try_reserve_reclaims_cached_memory():
    freed = []
    memory = KVMemory(100, reclaim=lambda n: freed.append(n) or n)
    assert memory.reserve(90) and memory.try_reserve(30)
    assert freed == [20] and memory.used == 100


def test_a_waiting_reservation_holds_no_thread_and_is_granted_by_the_release():
    memory = KVMemory(100)
    assert memory.reserve_async(80).result(0)
    granted_on: list[str] = []
    future = memory.reserve_async(50)
    future.add_done_callback(lambda f: granted_on.append(threading.current_thread().name))
    assert not future.done() and memory.waiting == 1
    releaser = threading.Thread(target=memory.release, args=(80,), name="releaser")
    releaser.start()
    releaser.join(5)
    assert future.result(0) is True and granted_on == ["releaser"]
    assert memory.used == 50 and memory.waiting == 0


def test_cancelling_the_head_of_the_queue_lets_the_ones_behind_it_in_at_once():
    memory = KVMemory(100)
    memory.reserve(60)
    cancel = Flag()
    big = memory.reserve_async(90, cancel)
    small = memory.reserve_async(30)  # it fits, but waits behind the big one
    assert not big.done() and not small.done()
    cancel.set()  # no release happens: the cancel itself serves the queue
    assert big.result(0) is False and small.result(0) is True
    assert memory.used == 90 and memory.waiting == 0


def test_a_reservation_cancelled_before_it_asks_is_answered_false_at_once():
    memory = KVMemory(100)
    cancel = Flag()
    cancel.set()
    assert memory.reserve_async(10, cancel).result(0) is False
    assert memory.used == 0 and memory.waiting == 0


def test_a_release_reclaims_cache_for_the_waiting_head():
    cached = [0]

    def reclaim(needed: int) -> int:
        freed = min(needed, cached[0])
        cached[0] -= freed
        return freed

    memory = KVMemory(100, reclaim=reclaim)
    memory.reserve(100)
    waiting = memory.reserve_async(70)
    cached[0] = 100  # the request that held it finished: its buffer is now only cache
    memory.release(0)  # the cache tells the memory, which asks it for what the head needs
    assert waiting.result(0) is True and memory.used == 100 and cached == [30]
