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

    def test_listing_skips_half_written_files(self, store: LocalStore) -> None:
        store.put("a/1", b"x")
        (store.root / "a" / ".tmp-crashed").write_bytes(b"partial")
        assert [i.key for i in store.list()] == ["a/1"]

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
