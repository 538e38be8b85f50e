"""Behaviour every ObjectStore must share, written once and run against each backend.

A test module subclasses ``StoreContract`` and provides a ``store`` fixture
(an empty store); pytest then runs these methods against that backend.
"""

from __future__ import annotations

import os
import time

import pytest

from storage.base import ObjectStore
from storage.errors import ObjectNotFound, ObjectTooLarge


class StoreContract:
    def test_put_get_round_trip(self, store: ObjectStore) -> None:
        store.put("ctx/a/0.bin", b"hello")
        assert store.get("ctx/a/0.bin") == b"hello"

    def test_put_accepts_memoryview(self, store: ObjectStore) -> None:
        buf = bytearray(os.urandom(4096))
        store.put("mv.bin", memoryview(buf)[100:3000])
        assert store.get("mv.bin") == bytes(buf[100:3000])

    def test_overwrite_replaces_whole_object(self, store: ObjectStore) -> None:
        store.put("k", b"first version, longer")
        store.put("k", b"second")
        assert store.get("k") == b"second"
        info = store.head("k")
        assert info is not None and (info.key, info.size) == ("k", 6)
        # when it was written (S3 keeps whole seconds; the server's clock is this machine's)
        assert time.time() - 60 < info.modified <= time.time() + 2

    def test_empty_object(self, store: ObjectStore) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        info = store.head("empty")
        assert info is not None and (info.key, info.size) == ("empty", 0)

    def test_get_range(self, store: ObjectStore) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get_range("r", 0, 10) == data[:10]
        assert store.get_range("r", 500, 100) == data[500:600]
        assert store.get_range("r", len(data) - 5, 100) == data[-5:]
        assert store.get_range("r", len(data) + 5, 10) == b""

    def test_missing_key(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            store.get("nope/0.bin")
        with pytest.raises(ObjectNotFound):
            store.get_range("nope/0.bin", 0, 10)
        assert store.head("nope/0.bin") is None

    def test_delete(self, store: ObjectStore) -> None:
        store.put("d", b"x")
        store.delete("d")
        assert store.head("d") is None
        store.delete("d")  # deleting a missing key is not an error

    def test_list_by_prefix_in_key_order(self, store: ObjectStore) -> None:
        for key in ("b/2", "a/1", "b/1", "c", "b10"):
            store.put(key, key.encode())
        assert [i.key for i in store.list("b/")] == ["b/1", "b/2"]
        assert [i.key for i in store.list("b")] == ["b/1", "b/2", "b10"]
        listed = list(store.list())
        assert [(i.key, i.size) for i in listed] == [(k, len(k)) for k in ("a/1", "b/1", "b/2", "b10", "c")]
        assert all(time.time() - 60 < i.modified <= time.time() + 2 for i in listed)

    def test_batched_calls_keep_order(self, store: ObjectStore) -> None:
        keys = [f"chunks/{i:03d}" for i in range(20)]
        for i, key in enumerate(keys):
            if i % 3:
                store.put(key, f"chunk {i}".encode())
        got = store.get_many(keys)
        assert got == [None if i % 3 == 0 else f"chunk {i}".encode() for i in range(20)]
        assert store.exists_many(keys) == [bool(i % 3) for i in range(20)]
        assert store.get_many([]) == [] and store.exists_many([]) == []

    def test_reads_stop_at_the_callers_limit(self, store: ObjectStore) -> None:
        store.put("big", bytes(1000))
        store.put("small", b"x" * 10)
        assert store.get("big", limit=1000) == bytes(1000)  # exactly the limit is allowed
        for _ in range(2):  # the second read may come from a cache in front of the backend
            with pytest.raises(ObjectTooLarge, match="over the reader's limit of 999"):
                store.get("big", limit=999)
        with pytest.raises(ObjectTooLarge):
            store.get_fresh("big", 0.0, limit=10)
        with pytest.raises(ObjectTooLarge):
            store.get_many(["small", "big"], limit=100)
        assert store.get_many(["small", "missing"], limit=10) == [b"x" * 10, None]
        with pytest.raises(ObjectNotFound):
            store.get("missing", limit=1)

    def test_get_into_gives_the_objects_bytes_whatever_the_buffer(self, store: ObjectStore) -> None:
        data = os.urandom(3000)
        store.put("obj", data)
        for size in (1, 3000, 3001, 8192):  # too small, exactly the object (no room to see its end), roomy
            buffer = memoryview(bytearray(size))
            assert bytes(store.get_into("obj", buffer, limit=3000)) == data
        with pytest.raises(ObjectTooLarge):
            store.get_into("obj", memoryview(bytearray(8192)), limit=2999)
        with pytest.raises(ObjectNotFound):
            store.get_into("missing", memoryview(bytearray(8192)))

    @pytest.mark.parametrize("key", ["", "/abs", "a//b", "../x", "a/../b", "a/./b", "sp ace", "a/"])
    def test_rejects_bad_keys(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(ValueError):
            store.put(key, b"x")
        with pytest.raises(ValueError):
            store.get(key)
