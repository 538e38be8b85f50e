"""The KV memory budget: reservations wait their turn, cancel cleanly, and never exceed the budget."""

from __future__ import annotations

import threading
import time

import pytest

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

    def take(name: str, nbytes: int) -> None:
        memory.reserve(nbytes)
        order.append(name)

    big = threading.Thread(target=take, args=("big", 90), daemon=True)
    big.start()
    while memory.waiting < 1:
        time.sleep(0.01)
    small = threading.Thread(target=take, args=("small", 10), daemon=True)
    small.start()
    while memory.waiting < 2:
        time.sleep(0.01)
    memory.release(20)  # the small one would fit now, but the big one came first
    time.sleep(0.2)
    assert order == []
    memory.release(80)
    big.join(5)
    small.join(5)
    assert order == ["big", "small"]


def test_a_cancelled_reservation_holds_nothing_and_unblocks_the_queue():
    memory = KVMemory(100)
    memory.reserve(100)
    cancel = threading.Event()
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
