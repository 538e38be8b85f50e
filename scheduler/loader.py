"""Fetch and decode the stored KV of a request's longest stored prefix.

The first chunk is probed at every acceptable level in one batched existence
check, so a prefix that is not stored costs one round trip, not one per
chunk. The chunks then stream in on a thread pool while earlier ones decode.
Any fault (a missing or unreadable object, bytes the codec rejects, a shape
that does not fit the model) ends the prefix at the chunk before it: the
caller recomputes the rest from text, and the fault is reported, not served.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from codec import CodecError, Level, decode_chunk
from scheduler.geometry import KVGeometry
from scheduler.layout import chunk_object_key
from storage import ObjectNotFound, ObjectStore, StorageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedChunk:
    index: int
    level: str
    tokens: int
    bytes: int


@dataclass
class PrefixLoad:
    """What came from the store for one request."""

    kv: torch.Tensor | None  # (layers, 2, kv_heads, tokens, head_dim), CPU
    chunks: list[LoadedChunk] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # one short kind per fault, for metrics

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)


class PrefixLoader:
    def __init__(
        self,
        store: ObjectStore,
        geometry: KVGeometry,
        chunk_size: int,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.store = store
        self.geometry = geometry
        self.chunk_size = chunk_size
        self.pool = pool

    def load(self, keys: Sequence[str], levels: Sequence[Level]) -> PrefixLoad:
        """Longest run of leading ``keys`` stored at the first of ``levels`` that chunk 0 has."""
        result = PrefixLoad(kv=None)
        if not keys or not levels:
            return result
        try:
            level = self.probe(keys[0], levels)
        except StorageError as exc:
            log.warning("KV store unavailable while probing %s: %s", self.store, exc)
            result.faults.append("store_unavailable")
            level = None
        if level is None:
            return result

        futures = [self.pool.submit(self.store.get, chunk_object_key(k, level.name)) for k in keys]
        parts: list[torch.Tensor] = []
        try:
            for index, future in enumerate(futures):
                data = self._fetched(future, index, result)
                kv = None if data is None else self._decoded(data, index, result)
                if kv is None:
                    break
                parts.append(kv)
                result.chunks.append(LoadedChunk(index, level.name, self.chunk_size, len(data)))
        finally:
            for future in futures:
                future.cancel()
        if parts:
            result.kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        return result

    def probe(self, first_key: str, levels: Sequence[Level]) -> Level | None:
        """The first of ``levels`` at which chunk 0 is stored: one batched existence check."""
        present = self.store.exists_many([chunk_object_key(first_key, lv.name) for lv in levels])
        return next((lv for lv, ok in zip(levels, present) if ok), None)

    def _fetched(self, future: Future[bytes], index: int, result: PrefixLoad) -> bytes | None:
        try:
            return future.result()
        except ObjectNotFound:
            if index == 0:
                # it existed a moment ago: deleted behind our back
                result.faults.append("object_missing")
                log.warning("KV chunk 0 vanished between probe and fetch")
            return None
        except StorageError as exc:
            log.warning("KV chunk %d unreadable, recomputing from there: %s", index, exc)
            result.faults.append("store_unavailable")
            return None

    def _decoded(self, data: bytes, index: int, result: PrefixLoad) -> torch.Tensor | None:
        try:
            kv = decode_chunk(data)
        except CodecError as exc:
            log.warning("KV chunk %d rejected by the codec, recomputing from there: %s", index, exc)
            result.faults.append("corrupt_chunk")
            return None
        expected = self.geometry.chunk_shape(self.chunk_size)
        if tuple(kv.shape) != expected:
            log.warning("KV chunk %d has shape %s, the model needs %s", index, tuple(kv.shape), expected)
            result.faults.append("shape_mismatch")
            return None
        return kv
