"""LocalStore, MemoryStore and the LRU tier run the shared ObjectStore contract."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage.base import ObjectStore
from storage.local import LocalStore
from storage.memory import MemoryStore
from storage.tiered import LRUCacheStore
from tests.support.store_contract import StoreContract


class TestLocalStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> ObjectStore:
        return LocalStore(tmp_path / "objects")

    def test_get_into_reads_into_the_buffer_when_the_object_fits(self, store: LocalStore) -> None:
        store.put("obj", b"abc")
        buffer = memoryview(bytearray(16))
        got = store.get_into("obj", buffer)
        assert isinstance(got, memoryview) and got.obj is buffer.obj and bytes(got) == b"abc"
        assert isinstance(store.get_into("obj", memoryview(bytearray(3))), bytes)  # no room: its own

    def test_listing_skips_half_written_files(self, store: LocalStore) -> None:
        store.put("a/1", b"x")
        (store.root / "a" / ".tmp-crashed").write_bytes(b"partial")
        assert [i.key for i in store.list()] == ["a/1"]

    def test_listing_a_prefix_walks_only_its_directory(self, store: LocalStore, monkeypatch) -> None:
        import os

        import storage.local

        for key in ("contexts/t1/a.json", "contexts/t1/b.json", "contexts/t2/c.json", "kv/x/0"):
            store.put(key, b"x")
        walked: list[str] = []
        real_walk = os.walk

        def walk(top, *args, **kwargs):  # type: ignore[no-untyped-def]
            walked.append(Path(top).relative_to(store.root).as_posix())
            return real_walk(top, *args, **kwargs)

        monkeypatch.setattr(storage.local.os, "walk", walk)
        assert [i.key for i in store.list("contexts/t1/")] == ["contexts/t1/a.json", "contexts/t1/b.json"]
        assert [i.key for i in store.list("contexts/t")] == [
            "contexts/t1/a.json",
            "contexts/t1/b.json",
            "contexts/t2/c.json",
        ]
        assert [i.key for i in store.list("kv/x/0")] == ["kv/x/0"]
        assert walked == ["contexts/t1", "contexts", "kv/x"]
        with pytest.raises(ValueError):
            list(store.list("../outside/"))

    def test_keys_stay_inside_the_root(self, store: LocalStore, tmp_path: Path) -> None:
        with pytest.raises(ValueError):
            store.put("../escape", b"x")
        assert not (tmp_path / "escape").exists()


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> ObjectStore:
        return MemoryStore()

    def test_put_copies_the_callers_buffer(self, store: MemoryStore) -> None:
        buf = bytearray(b"abc")
        store.put("k", memoryview(buf))
        buf[0] = ord("z")
        assert store.get("k") == b"abc"


class TestLRUOverMemory(StoreContract):
    @pytest.fixture
    def store(self) -> ObjectStore:
        return LRUCacheStore(MemoryStore(), capacity_bytes=1 << 20)


class TestLRUOverLocal(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> ObjectStore:
        return LRUCacheStore(LocalStore(tmp_path), capacity_bytes=64)  # tiny: exercises eviction
