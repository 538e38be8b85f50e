"""The in-memory LRU tier: byte bound, recency, counters, write-through, single flight."""

from __future__ import annotations

import threading
import time

import pytest

from storage.base import DEFAULT_LIMIT
from storage.errors import ObjectNotFound, StorageUnavailable
from storage.memory import MemoryStore
from storage.tiered import LRUCacheStore


class CountingStore(MemoryStore):
    """A MemoryStore that counts backend calls and can be made slow or broken."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0
        self.delay = 0.0
        self.down = False

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        self.gets += 1
        time.sleep(self.delay)
        if self.down:
            raise StorageUnavailable("backend down")
        return super().get(key, limit)


@pytest.fixture
def backend() -> CountingStore:
    return CountingStore()


def test_second_get_is_a_hit(backend: CountingStore) -> None:
    backend.put("k", b"abc")
    cache = LRUCacheStore(backend, 100)
    assert cache.get("k") == b"abc" and cache.get("k") == b"abc"
    assert backend.gets == 1
    assert (cache.hits, cache.misses) == (1, 1)


def test_put_writes_through_and_populates(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    cache.put("k", memoryview(bytearray(b"data")))
    assert backend.get("k") == b"data"
    backend.gets = 0
    assert cache.get("k") == b"data" and backend.gets == 0


def test_failed_write_leaves_nothing_cached(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    cache.put("k", b"old")

    def broken_put(key: str, data: bytes | memoryview) -> None:
        raise StorageUnavailable("down")

    backend.put = broken_put  # type: ignore[method-assign]
    with pytest.raises(StorageUnavailable):
        cache.put("k", b"new")
    assert cache.entries == 0  # neither the old bytes (maybe replaced) nor the new (maybe not written)


def test_evicts_least_recently_used_by_bytes(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, capacity_bytes=10)
    cache.put("a", b"aaaa")
    cache.put("b", b"bbbb")
    cache.get("a")  # a is now the most recent
    cache.put("c", b"cccc")  # 12 bytes > 10: b goes
    assert cache.evictions == 1 and cache.size_bytes == 8
    assert cache.exists_many(["a", "c"]) == [True, True]
    backend.gets = 0
    cache.get("a"), cache.get("c")
    assert backend.gets == 0
    cache.get("b")
    assert backend.gets == 1


def test_object_bigger_than_capacity_is_not_cached(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, capacity_bytes=4)
    cache.put("small", b"ab")
    cache.put("big", b"0123456789")
    assert cache.size_bytes == 2 and cache.entries == 1 and cache.evictions == 0
    assert cache.get("big") == b"0123456789"


def test_get_range_from_cached_whole_object(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    cache.put("k", b"0123456789")
    backend.gets = 0
    assert cache.get_range("k", 3, 4) == b"3456"
    assert cache.get_range("k", 8, 10) == b"89"
    assert backend.gets == 0 and cache.hits == 2


def test_get_range_miss_passes_through_without_caching(backend: CountingStore) -> None:
    backend.put("k", b"0123456789")
    cache = LRUCacheStore(backend, 100)
    assert cache.get_range("k", 2, 3) == b"234"
    assert cache.entries == 0 and cache.misses == 1


def test_delete_invalidates(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    cache.put("k", b"v")
    cache.delete("k")
    with pytest.raises(ObjectNotFound):
        cache.get("k")
    assert cache.head("k") is None and cache.size_bytes == 0


def test_overwrite_behind_the_cache_is_not_seen(backend: CountingStore) -> None:
    """The documented limit: keys are content-addressed, so a cached entry is trusted until evicted."""
    cache = LRUCacheStore(backend, 100)
    cache.put("k", b"original")
    backend.put("k", b"changed elsewhere")
    backend.delete("k")
    assert cache.get("k") == b"original"
    cache.clear()
    with pytest.raises(ObjectNotFound):
        cache.get("k")


def test_errors_are_not_cached(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    with pytest.raises(ObjectNotFound):
        cache.get("k")
    backend.put("k", b"now here")
    assert cache.get("k") == b"now here"


def test_hits_survive_a_backend_outage(backend: CountingStore) -> None:
    cache = LRUCacheStore(backend, 100)
    cache.put("hot", b"v")
    backend.down = True
    assert cache.get("hot") == b"v"
    with pytest.raises(StorageUnavailable):
        cache.get("cold")


def test_concurrent_misses_share_one_fetch(backend: CountingStore) -> None:
    backend.put("k", b"shared")
    backend.delay = 0.2
    cache = LRUCacheStore(backend, 100)
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("k"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [b"shared"] * 8
    assert backend.gets == 1 and cache.misses == 1 and cache.hits == 7


def test_concurrent_miss_failure_reaches_every_waiter(backend: CountingStore) -> None:
    backend.put("k", b"x")
    backend.delay, backend.down = 0.2, True
    cache = LRUCacheStore(backend, 100)
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            cache.get("k")
        except StorageUnavailable as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and cache.entries == 0


def test_write_during_a_fetch_wins(backend: CountingStore) -> None:
    backend.put("k", b"old")
    backend.delay = 0.3
    cache = LRUCacheStore(backend, 100)
    reader = threading.Thread(target=cache.get, args=("k",))
    reader.start()
    time.sleep(0.1)
    backend.delay = 0.0
    cache.put("k", b"new")
    reader.join()
    assert cache.get("k") == b"new"


def test_get_many_mixes_hits_misses_and_absent(backend: CountingStore) -> None:
    backend.put("b", b"B")
    cache = LRUCacheStore(backend, 100)
    cache.put("a", b"A")
    assert cache.get_many(["a", "b", "c"]) == [b"A", b"B", None]
    assert (cache.hits, cache.misses) == (1, 2)
    assert cache.get_many(["b"]) == [b"B"] and cache.hits == 2


def test_capacity_must_be_positive(backend: CountingStore) -> None:
    with pytest.raises(ValueError):
        LRUCacheStore(backend, 0)


def test_get_fresh_rereads_a_copy_older_than_its_bound() -> None:
    """A prefix index deleted by another replica stops being served once the bound has passed."""
    backend = MemoryStore()
    cache = LRUCacheStore(backend, 1 << 20)
    backend.put("kv/a/index.json", b"v1")
    assert cache.get_fresh("kv/a/index.json", 60.0) == b"v1"
    backend.put("kv/a/index.json", b"v2")  # behind the cache's back
    assert cache.get_fresh("kv/a/index.json", 60.0) == b"v1"  # within the bound: the cached copy
    assert cache.get_fresh("kv/a/index.json", 0.0) == b"v2"
    backend.delete("kv/a/index.json")
    with pytest.raises(ObjectNotFound):
        cache.get_fresh("kv/a/index.json", 0.0)
