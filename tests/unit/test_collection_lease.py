"""The collection lease: one replica's periodic sweep per period over a shared store."""

from __future__ import annotations

import json

import pytest

from scheduler.collection_lease import CollectionLease, Lease, parse_lease
from scheduler.layout import COLLECTION_LEASE_KEY
from storage.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def lease(store, holder, clock, **kw) -> CollectionLease:
    return CollectionLease(store, holder, 60.0, clock=clock, sleep=lambda s: None, **kw)


def test_one_replica_sweeps_per_period_and_renews():
    store, clock = MemoryStore(), Clock()
    a, b = lease(store, "a", clock), lease(store, "b", clock)
    assert a.acquire()
    assert not b.acquire()  # a holds it for 1.5 periods
    clock.now += 60
    assert a.acquire()  # a renews at its next sweep
    clock.now += 60
    assert not b.acquire()
    assert a.read() == Lease("a", clock.now - 60 + 90)


def test_a_dead_holder_hands_over_after_its_lease_ends():
    store, clock = MemoryStore(), Clock()
    a, b = lease(store, "a", clock), lease(store, "b", clock)
    assert a.acquire()
    clock.now += 89
    assert not b.acquire()
    clock.now += 2
    assert b.acquire()
    assert not a.acquire()  # a came back: b holds it now


def test_racing_writers_agree_on_the_last_one():
    """Both read no lease and both write; after the settle time both read the later PUT."""
    store, clock = MemoryStore(), Clock()
    b = lease(store, "b", clock)

    def a_sleeps(_: float) -> None:  # while a settles, b (which also read no lease) writes its own
        store.put(COLLECTION_LEASE_KEY, json.dumps({"holder": "b", "until": clock.now + 90}).encode())

    a = CollectionLease(store, "a", 60.0, clock=clock, sleep=a_sleeps)
    assert not a.acquire()
    assert b.read().holder == "b"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"[1, 2]",
        b'{"holder": "", "until": 5}',
        b'{"holder": 7, "until": 5}',
        b'{"holder": "a", "until": "soon"}',
        b'{"holder": "a", "until": true}',
        b'{"holder": "a", "until": NaN}',
        b'{"holder": "a"}',
        json.dumps({"holder": "x" * 254, "until": 5}).encode(),
    ],
)
def test_anything_but_a_lease_reads_as_none(data):
    assert parse_lease(data) is None


def test_a_garbage_or_oversized_lease_is_taken_over():
    store, clock = MemoryStore(), Clock()
    store.put(COLLECTION_LEASE_KEY, b"\x00" * 10_000)
    assert lease(store, "a", clock).acquire()
    store.put(COLLECTION_LEASE_KEY, b'{"holder": "b", "until": "forever"}')
    assert lease(store, "a", clock).acquire()
