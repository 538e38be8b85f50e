"""In-process store: for tests and for throwaway gateways (``memory://``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from storage.base import ObjectInfo, ObjectStore, check_key
from storage.errors import ObjectNotFound


class MemoryStore(ObjectStore):
    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes:
        try:
            return self._objects[check_key(key)]
        except KeyError:
            raise ObjectNotFound(key) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get(key)[start : start + length]

    def put(self, key: str, data: bytes | memoryview) -> None:
        blob = bytes(data)
        with self._lock:
            self._objects[check_key(key)] = blob

    def head(self, key: str) -> ObjectInfo | None:
        blob = self._objects.get(check_key(key))
        return None if blob is None else ObjectInfo(key, len(blob))

    def resident_many(self, keys: Iterable[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, len(v)) for k, v in self._objects.items() if k.startswith(prefix))
        return iter([ObjectInfo(k, n) for k, n in items])
