"""Pre-encoded contexts: every chunk (and the tail) at every level, the prefix index, then the manifest.

The manifest is written last, so a context whose upload was interrupted is
never listed; its orphaned chunks still serve as a prefix cache once the
index lists them, until garbage collection's grace period has passed
(scheduler/lifecycle.py).

Contexts belong to a tenant (``KeySpace.tenant``): another tenant's context
is not listed, and reading or deleting it answers as if it did not exist. An
expired context (``ttl_seconds``) is neither served, listed nor readable; the
collector deletes it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from codec import Level, encode_chunk, level_digest
from scheduler.errors import ContextNotFound, ManifestError, PrefixIndexError
from scheduler.index import ChunkEntry, PrefixIndex, StoredObject, TailEntry
from scheduler.layout import (
    MANIFEST_PREFIX,
    chunk_dir,
    chunk_object_key,
    context_id_from_manifest_key,
    index_key,
    manifest_key,
    used_key,
)
from scheduler.manifest import Manifest
from scheduler.prefix import CONTEXT_ID_PATTERN, Fingerprint, chunk_keys, context_id, tail_key
from scheduler.tenancy import PUBLIC, KeySpace
from storage import ObjectNotFound, ObjectStore, StorageError

# A prefix's recency marker is rewritten at most this often by one gateway: eviction needs the
# order of use to within minutes, not a write per request.
TOUCH_INTERVAL_S = 60.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tail:
    """A context's trailing partial chunk: its key, and where its tokens start."""

    key: str
    start: int
    tokens: int


class ContextStore:
    def __init__(
        self,
        store: ObjectStore,
        fingerprint: Fingerprint,
        model_name: str,
        chunk_size: int,
        pool: ThreadPoolExecutor,
        codec_gate: AbstractContextManager[Any] | None = None,
    ) -> None:
        self.store = store
        # held around each encode: the codec's CPU work of all requests shares the thread budget
        self.codec_gate = codec_gate or nullcontext()
        self.fingerprint = fingerprint
        self.model_name = model_name
        self.chunk_size = chunk_size
        self.pool = pool
        self._touched: dict[str, float] = {}  # first chunk key -> when this process last marked it
        self._touch_lock = threading.Lock()

    def context_id(self, token_ids: Sequence[int], space: KeySpace = PUBLIC) -> str:
        return context_id(self.fingerprint, token_ids, space.salt)

    def keys(self, token_ids: Sequence[int], space: KeySpace = PUBLIC) -> list[str]:
        return chunk_keys(self.fingerprint, token_ids, self.chunk_size, space.salt)

    def tail(self, token_ids: Sequence[int], keys: Sequence[str]) -> Tail | None:
        """The tokens after the last full chunk, when there is a full chunk to hang them on."""
        start = len(keys) * self.chunk_size
        if not keys or start == len(token_ids):
            return None
        return Tail(tail_key(keys[-1], token_ids[start:]), start, len(token_ids) - start)

    def save_chunks(
        self,
        keys: Sequence[str],
        kv: torch.Tensor,
        levels: Sequence[Level],
        first: int = 0,
        tail: Tail | None = None,
        expires: int | None = None,
    ) -> dict[str, int]:
        """Encode and store chunks ``first..len(keys)`` of ``kv`` (which starts at chunk 0), and
        ``tail``; then add them to the prefix index, live until ``expires`` (None: no limit).
        Returns the bytes written per level."""
        level_bytes = {level.name: 0 for level in levels}
        pieces = [(keys[i], i * self.chunk_size, self.chunk_size) for i in range(first, len(keys))]
        if tail is not None:
            pieces.append((tail.key, tail.start, tail.tokens))
        uploads = []
        written: dict[str, dict[str, StoredObject]] = {}
        for key, start, tokens in pieces:
            chunk = kv[:, :, :, start : start + tokens]
            for level in levels:
                with self.codec_gate:
                    data = encode_chunk(chunk, level)
                digest = level_digest(level)
                level_bytes[level.name] += len(data)
                written.setdefault(key, {})[level.name] = StoredObject(digest=digest, bytes=len(data))
                uploads.append(
                    self.pool.submit(self.store.put, chunk_object_key(key, level.name, digest), data)
                )
        for upload in uploads:
            upload.result()  # re-raises the first StorageError
        if written and keys:
            entries = PrefixIndex(
                fingerprint=self.fingerprint.hex,
                chunk_size=self.chunk_size,
                chunks={
                    k: ChunkEntry(objects=written[k], expires=expires) for k in keys[first:] if k in written
                },
                tails={}
                if tail is None or tail.key not in written
                else {
                    tail.key: TailEntry(
                        objects=written[tail.key], parent=keys[-1], tokens=tail.tokens, expires=expires
                    )
                },
            )
            self._update_index(keys[0], lambda index: index.merged(entries))
        return level_bytes

    def _update_index(self, first_key: str, change: Callable[[PrefixIndex], PrefixIndex]) -> None:
        update_index(self.store, first_key, self.fingerprint.hex, self.chunk_size, change)

    def save(
        self,
        token_ids: Sequence[int],
        kv: torch.Tensor,
        levels: Sequence[Level],
        compute_seconds: float,
        space: KeySpace = PUBLIC,
        ttl_seconds: int | None = None,
    ) -> Manifest:
        """Encode and store each full chunk of ``kv`` and its tail at each level; the manifest goes last.

        With ``ttl_seconds`` the context expires that long after this call; without, it is pinned."""
        started = time.perf_counter()
        created = int(time.time())
        expires = None if ttl_seconds is None else created + ttl_seconds
        keys = self.keys(token_ids, space)
        tail = self.tail(token_ids, keys)
        level_bytes = self.save_chunks(keys, kv, levels, tail=tail, expires=expires)
        manifest = Manifest(
            id=self.context_id(token_ids, space),
            model=self.model_name,
            fingerprint=self.fingerprint.hex,
            chunk_size=self.chunk_size,
            tokens=len(token_ids),
            chunk_keys=keys,
            tail_key=None if tail is None else tail.key,
            tail_tokens=0 if tail is None else tail.tokens,
            level_bytes=level_bytes,
            created=created,
            encode_seconds=round(compute_seconds + time.perf_counter() - started, 4),
            tenant=space.tenant,
            expires=expires,
        )
        self.store.put(manifest_key(manifest.id), manifest.to_bytes())
        return manifest

    def exists(self, ctx_id: str) -> bool:
        """Whether the manifest is stored (raises StorageError when the store cannot say)."""
        return self.store.head(manifest_key(ctx_id)) is not None

    def get(self, ctx_id: str, space: KeySpace = PUBLIC) -> Manifest:
        """The context, when it is ``space``'s tenant's and has not expired; else ContextNotFound."""
        if not re.fullmatch(CONTEXT_ID_PATTERN, ctx_id):
            raise ContextNotFound(ctx_id)
        try:
            data = self.store.get(manifest_key(ctx_id))
        except ObjectNotFound:
            raise ContextNotFound(ctx_id) from None
        manifest = Manifest.from_bytes(data)
        if manifest.tenant != space.tenant or manifest.expired(time.time()):
            raise ContextNotFound(ctx_id)  # the same answer as for an id never stored
        return manifest

    def manifests(self) -> list[Manifest]:
        return read_manifests(self.store)

    def list(self, space: KeySpace = PUBLIC) -> list[Manifest]:
        """This model's live contexts of ``space``'s tenant."""
        now = time.time()
        manifests = [
            m
            for m in self.manifests()
            if m.fingerprint == self.fingerprint.hex and m.tenant == space.tenant and not m.expired(now)
        ]
        return sorted(manifests, key=lambda m: (m.created, m.id))

    def delete(self, ctx_id: str, space: KeySpace = PUBLIC) -> Manifest:
        manifest = self.get(ctx_id, space)
        self.remove(manifest)
        return manifest

    def remove(self, manifest: Manifest) -> int:
        return remove_context(self.store, manifest, self.pool)

    def touch(self, first_key: str) -> None:
        """Mark the prefix that starts at ``first_key`` as used now (eviction is least recently used
        first); at most once per ``TOUCH_INTERVAL_S`` per prefix per process. Best effort."""
        now = time.monotonic()
        with self._touch_lock:
            if now - self._touched.get(first_key, -TOUCH_INTERVAL_S) < TOUCH_INTERVAL_S:
                return
            self._touched[first_key] = now
            if len(self._touched) > 65536:  # forget the oldest half: a bound, not a cache
                for key in sorted(self._touched, key=self._touched.get)[:32768]:
                    del self._touched[key]
        try:
            self.store.put(used_key(first_key), b"")
        except StorageError as exc:
            log.warning("could not mark prefix %s as used: %s", first_key[:16], exc)


# -- on the store alone (the collector runs these without a model) ---------------------------------


def update_index(
    store: ObjectStore,
    first_key: str,
    fingerprint: str,
    chunk_size: int,
    change: Callable[[PrefixIndex], PrefixIndex],
) -> None:
    """Read, change and write the index under ``first_key`` (a missing or bad one starts empty)."""
    key = index_key(first_key)
    try:
        index = PrefixIndex.from_bytes(store.get(key))
        if index.fingerprint != fingerprint or index.chunk_size != chunk_size:
            raise PrefixIndexError("index of another model or chunk size")
    except (ObjectNotFound, PrefixIndexError) as exc:
        if not isinstance(exc, ObjectNotFound):
            log.warning("replacing unreadable prefix index %s: %s", key, exc)
        index = PrefixIndex(fingerprint=fingerprint, chunk_size=chunk_size)
    index = change(index)
    if index.empty:
        store.delete(key)
    else:
        store.put(key, index.to_bytes())


def read_manifests(store: ObjectStore, known: Mapping[str, Manifest] | None = None) -> list[Manifest]:
    """Every readable manifest in the store: all models and tenants, expired or not.

    ``known``: manifests the caller read moments ago, by id; those still
    listed are taken from it instead of being read again."""
    found = []
    for info in store.list(MANIFEST_PREFIX):
        ctx_id = context_id_from_manifest_key(info.key)
        if ctx_id is None:
            continue
        if known is not None and ctx_id in known:
            found.append(known[ctx_id])
            continue
        try:
            found.append(Manifest.from_bytes(store.get(info.key)))
        except (ObjectNotFound, ManifestError) as exc:
            log.warning("skipping manifest %s: %s", info.key, exc)
    return found


def remove_context(
    store: ObjectStore,
    manifest: Manifest,
    pool: ThreadPoolExecutor | None = None,
    known: Mapping[str, Manifest] | None = None,
) -> int:
    """Remove a context, and those of its chunks no other live context uses; returns the bytes freed.

    The manifest goes first, so the context disappears at once; then the
    index forgets the doomed chunks (so no reader plans with them), then
    their objects go. Chunks a shared prefix still needs are kept. The
    manifests are listed again here (one written since the caller read them
    keeps its chunks); ``known`` saves reading again those already read.
    """
    store.delete(manifest_key(manifest.id))
    now = time.time()
    still_used = {
        key
        for other in read_manifests(store, known)
        if other.id != manifest.id and not other.expired(now)
        for key in other.stored_keys
    }
    doomed = {key for key in manifest.stored_keys if key not in still_used}
    # listed first: the doomed first chunk's directory holds the index, which the update deletes
    objects = [info for key in sorted(doomed) for info in store.list(chunk_dir(key))]
    if doomed and manifest.chunk_keys:
        update_index(
            store,
            manifest.chunk_keys[0],
            manifest.fingerprint,
            manifest.chunk_size,
            lambda i: i.without(doomed),
        )
    if pool is None:
        for info in objects:
            store.delete(info.key)
    else:
        for future in [pool.submit(store.delete, info.key) for info in objects]:
            future.result()
    return len(manifest.to_bytes()) + sum(info.size for info in objects)
