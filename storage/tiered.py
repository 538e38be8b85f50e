"""A byte-bounded in-memory LRU in front of any ObjectStore, so a hot context is fetched once.

Writes go through to the backend first and then populate the cache; reads of
a cached object never touch the backend. Concurrent misses on one key share a
single backend fetch.

Limit, by design: entries are trusted until evicted. Chunk keys name one
encoding of one context (content-addressed), so an object is never rewritten
with different bytes under the same key by a well-behaved writer. An object
overwritten or deleted *behind this process's back* (by another process,
directly in the bucket) keeps being served from this cache, with the bytes
this process last saw, until it is evicted, deleted or rewritten through this
store. For an object corrupted or deleted behind our back that is the correct
answer; for a key reused for different content it is not, which is why keys
must never be reused. Objects that other processes do rewrite (a prefix
index, which lists what may be read) are read with ``get_fresh``, which
bounds how old a cached copy may be.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

from storage.base import DEFAULT_LIMIT, ObjectInfo, ObjectStore, check_key, check_size


class LRUCacheStore(ObjectStore):
    """``hits``, ``misses``, ``evictions``, ``size_bytes`` and ``entries`` are read by metrics."""

    def __init__(self, backend: ObjectStore, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("capacity_bytes must be positive")
        self.backend = backend
        self.url = backend.url
        self.prior_bytes_per_second = backend.prior_bytes_per_second
        self.capacity_bytes = capacity_bytes
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._cached_at: dict[str, float] = {}  # monotonic time each entry was read or written
        self._inflight: dict[str, Future[bytes]] = {}
        self._writes = 0  # bumped by every put/delete, so a batch fetch can tell it raced one
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        return len(self._entries)

    # -- cache bookkeeping (call with the lock held) --------------------------

    def _lookup(self, key: str) -> bytes | None:
        blob = self._entries.get(key)
        if blob is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return blob

    def _insert(self, key: str, blob: bytes) -> None:
        self._drop(key)
        if len(blob) > self.capacity_bytes:
            return  # would evict everything and still not fit
        self._entries[key] = blob
        self._cached_at[key] = time.monotonic()
        self.size_bytes += len(blob)
        while self.size_bytes > self.capacity_bytes:
            old_key, old = self._entries.popitem(last=False)
            self._cached_at.pop(old_key, None)
            self.size_bytes -= len(old)
            self.evictions += 1

    def _drop(self, key: str) -> None:
        old = self._entries.pop(key, None)
        self._cached_at.pop(key, None)
        if old is not None:
            self.size_bytes -= len(old)

    def _invalidate(self, key: str) -> None:
        self._drop(key)
        self._writes += 1
        # A fetch in flight may return what was there before this write/delete: it must
        # not land in the cache, so forget it (its waiters still get its answer).
        self._inflight.pop(key, None)

    # -- reads -----------------------------------------------------------------

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        """A fetch shared with a concurrent caller of the same key runs under the limit of whoever
        started it (callers of one key ask with one limit: it is set by what the key holds)."""
        check_key(key)
        with self._lock:
            blob = self._lookup(key)
            if blob is not None:
                check_size(key, len(blob), limit)
                return blob
            pending = self._inflight.get(key)
            if pending is None:
                self.misses += 1
                pending = self._inflight[key] = Future()
                owner = True
            else:
                self.hits += 1  # served by another caller's fetch: not a second round trip
                owner = False
        if not owner:
            blob = pending.result()
            check_size(key, len(blob), limit)
            return blob
        try:
            blob = self.backend.get(key, limit)
        except BaseException as exc:
            with self._lock:
                if self._inflight.get(key) is pending:
                    del self._inflight[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            if self._inflight.get(key) is pending:
                del self._inflight[key]
                self._insert(key, blob)
        pending.set_result(blob)
        return blob

    def get_fresh(self, key: str, max_age_s: float, limit: int = DEFAULT_LIMIT) -> bytes:
        check_key(key)
        with self._lock:
            cached_at = self._cached_at.get(key)
            if cached_at is not None and time.monotonic() - cached_at > max_age_s:
                self._invalidate(key)
        return self.get(key, limit)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_key(key)
        with self._lock:
            blob = self._lookup(key)
            if blob is None:
                self.misses += 1
        if blob is not None:
            return blob[start : start + length]
        # Ranges are not cached on their own: a range is one level of a chunk, and caching
        # slices would store the same bytes under many overlapping entries.
        return self.backend.get_range(key, start, length)

    def head(self, key: str) -> ObjectInfo | None:
        # always the backend's answer: a caller asks to learn what the store holds now (and when it
        # was written), and a cached copy knows neither
        return self.backend.head(check_key(key))

    def get_many(self, keys: Iterable[str], limit: int = DEFAULT_LIMIT) -> list[bytes | None]:
        keys = [check_key(k) for k in keys]
        out: list[bytes | None] = [None] * len(keys)
        missing: list[int] = []
        with self._lock:
            writes_before = self._writes
            for i, key in enumerate(keys):
                blob = self._lookup(key)
                if blob is None:
                    missing.append(i)
                    self.misses += 1
                else:
                    out[i] = blob
        for key, blob in zip(keys, out, strict=True):
            if blob is not None:
                check_size(key, len(blob), limit)
        if missing:
            fetched = self.backend.get_many([keys[i] for i in missing], limit)
            with self._lock:
                keep = self._writes == writes_before  # else some fetched bytes may be stale
                for i, blob in zip(missing, fetched, strict=True):
                    out[i] = blob
                    if blob is not None and keep:
                        self._insert(keys[i], blob)
        return out

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        keys = [check_key(k) for k in keys]
        with self._lock:
            out = [k in self._entries for k in keys]
        unknown = [i for i, present in enumerate(out) if not present]
        if unknown:
            for i, present in zip(unknown, self.backend.exists_many([keys[i] for i in unknown]), strict=True):
                out[i] = present
        return out

    def resident_many(self, keys: Iterable[str]) -> list[bool]:
        keys = list(keys)
        with self._lock:
            cached = [k in self._entries for k in keys]
        return [c or r for c, r in zip(cached, self.backend.resident_many(keys), strict=True)]

    # -- writes and pass-through -----------------------------------------------

    def put(self, key: str, data: bytes | memoryview) -> None:
        check_key(key)
        with self._lock:
            self._invalidate(key)
        self.backend.put(key, data)
        # The caller may reuse its buffer after put returns: keep our own immutable copy.
        blob = data if isinstance(data, bytes) else bytes(data)
        with self._lock:
            self._insert(key, blob)

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._invalidate(key)
        self.backend.delete(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.backend.list(prefix)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._cached_at.clear()
            self.size_bytes = 0

    def close(self) -> None:
        self.clear()
        self.backend.close()

    def __repr__(self) -> str:
        return f"LRUCacheStore({self.backend!r}, capacity_bytes={self.capacity_bytes})"
