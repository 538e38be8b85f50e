"""In-process store: for tests and for throwaway gateways (``memory://``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from storage.base import DEFAULT_LIMIT, ObjectInfo, ObjectStore, check_key, check_size
from storage.errors import ObjectNotFound


class MemoryStore(ObjectStore):
    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._objects: dict[str, bytes] = {}
        self._written: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        try:
            blob = self._objects[check_key(key)]
        except KeyError:
            raise ObjectNotFound(key) from None
        check_size(key, len(blob), limit)
        return blob

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self.get(key)[start : start + length]

    def put(self, key: str, data: bytes | memoryview) -> None:
        blob = bytes(data)
        with self._lock:
            self._objects[check_key(key)] = blob
            self._written[key] = time.time()

    def head(self, key: str) -> ObjectInfo | None:
        blob = self._objects.get(check_key(key))
        return None if blob is None else ObjectInfo(key, len(blob), self._written.get(key, 0.0))

    def resident_many(self, keys: Iterable[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    def delete(self, key: str) -> None:
        with self._lock:
            self._objects.pop(check_key(key), None)
            self._written.pop(key, None)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted(
                (k, len(v), self._written.get(k, 0.0)) for k, v in self._objects.items() if k.startswith(prefix)
            )
        return iter([ObjectInfo(k, n, t) for k, n, t in items])
