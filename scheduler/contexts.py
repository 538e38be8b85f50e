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
from scheduler.index import ChunkEntry, PrefixIndex, StoredObject, TailEntry, later
from scheduler.layout import (
    MANIFEST_PREFIX,
    chunk_dir,
    chunk_object_key,
    context_id_from_manifest_key,
    index_key,
    manifest_key,
    manifest_prefix,
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
class StoredPieces:
    """What the store already holds of a context, before it is (re-)encoded.

    A piece is a full chunk or the tail, named by its key. ``present`` is what
    a save can keep (its objects exist, at this gateway's level digests),
    ``missing`` what it must encode; ``manifest`` is the context's own record
    when there is one (this model's, this tenant's, not expired)."""

    present: dict[str, dict[str, StoredObject]]
    missing: dict[str, list[Level]]
    manifest: Manifest | None

    @property
    def complete(self) -> bool:
        return not self.missing


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

    def stored_pieces(
        self, token_ids: Sequence[int], levels: Sequence[Level], space: KeySpace = PUBLIC
    ) -> StoredPieces:
        """Which of the context's pieces are stored at which of ``levels``: one GET of the manifest
        and of the index, one LIST per piece (an object the index lists may have been deleted)."""
        keys = self.keys(token_ids, space)
        tail = self.tail(token_ids, keys)
        pieces = [*keys, *([tail.key] if tail is not None else [])]
        try:
            manifest: Manifest | None = self.get(self.context_id(token_ids, space), space)
        except ContextNotFound:
            manifest = None
        entries: dict[str, ChunkEntry] = {}
        if keys:
            try:
                index = PrefixIndex.read(self.store, index_key(keys[0]))
            except (ObjectNotFound, PrefixIndexError):
                index = None
            if index is not None and index.fingerprint == self.fingerprint.hex:
                entries = {**index.chunks, **index.tails}
        on_store = [
            {info.key for info in objects}
            for objects in self.pool.map(lambda key: list(self.store.list(chunk_dir(key))), pieces)
        ]
        present: dict[str, dict[str, StoredObject]] = {}
        missing: dict[str, list[Level]] = {}
        for key, names in zip(pieces, on_store, strict=True):
            for level in levels:
                digest = level_digest(level)
                listed = entries[key].find(level.name, digest) if key in entries else None
                if listed is not None and chunk_object_key(key, level.name, digest) in names:
                    present.setdefault(key, {})[level.name] = listed
                else:
                    missing.setdefault(key, []).append(level)
        return StoredPieces(present, missing, manifest)

    def save_chunks(
        self,
        keys: Sequence[str],
        kv: torch.Tensor,
        levels: Sequence[Level],
        first: int = 0,
        tail: Tail | None = None,
        expires: int | None = None,
        stored: StoredPieces | None = None,
    ) -> dict[str, int]:
        """Encode and store chunks ``first..len(keys)`` of ``kv`` (which starts at chunk 0), and
        ``tail``; then add them to the prefix index, live until ``expires`` (None: no limit).
        With ``stored``, only its missing pieces are encoded; its present ones are kept (``kv``
        may then be None when nothing is missing). Returns the bytes per level of all pieces."""
        level_bytes = {level.name: 0 for level in levels}
        pieces = [(keys[i], i * self.chunk_size, self.chunk_size) for i in range(first, len(keys))]
        if tail is not None:
            pieces.append((tail.key, tail.start, tail.tokens))
        uploads = []
        written: dict[str, dict[str, StoredObject]] = {}
        for key, start, tokens in pieces:
            kept = {} if stored is None else stored.present.get(key, {})
            for name, obj in kept.items():
                level_bytes[name] += obj.bytes
                written.setdefault(key, {})[name] = obj
            to_encode = [level for level in levels if level.name not in kept]
            if not to_encode:
                continue
            chunk = kv[:, :, :, start : start + tokens]
            for level in to_encode:
                with self.codec_gate:
                    data = encode_chunk(chunk, level, position=start)
                digest = level_digest(level)
                level_bytes[level.name] += len(data)
                written.setdefault(key, {})[level.name] = StoredObject(
                    level=level.name, digest=digest, bytes=len(data)
                )
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
                    k: ChunkEntry(objects=tuple(written[k].values()), expires=expires)
                    for k in keys[first:]
                    if k in written
                },
                tails={}
                if tail is None or tail.key not in written
                else {
                    tail.key: TailEntry(
                        objects=tuple(written[tail.key].values()),
                        parent=keys[-1],
                        tokens=tail.tokens,
                        expires=expires,
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
        kv: torch.Tensor | None,
        levels: Sequence[Level],
        compute_seconds: float,
        space: KeySpace = PUBLIC,
        ttl_seconds: int | None = None,
        stored: StoredPieces | None = None,
    ) -> Manifest:
        """Encode and store each full chunk of ``kv`` and its tail at each level; the manifest goes last.

        With ``ttl_seconds`` the context expires that long after this call; without, it is pinned.
        With ``stored`` (``stored_pieces``), what it lists as present is kept, not encoded again; a
        context already recorded keeps its creation time, and the later of the two expiries
        (pinned outlives any TTL), so a repeated save never shortens a context's life."""
        started = time.perf_counter()
        created = int(time.time())
        expires = None if ttl_seconds is None else created + ttl_seconds
        previous = None if stored is None else stored.manifest
        if previous is not None:
            created, expires = previous.created, later(previous.expires, expires)
        keys = self.keys(token_ids, space)
        tail = self.tail(token_ids, keys)
        level_bytes = self.save_chunks(keys, kv, levels, tail=tail, expires=expires, stored=stored)
        if previous is not None:  # levels stored before and not asked for now stay listed
            level_bytes = {**previous.level_bytes, **level_bytes}
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
        self.store.put(manifest_key(manifest.id, manifest.tenant), manifest.to_bytes())
        return manifest

    def get(self, ctx_id: str, space: KeySpace = PUBLIC) -> Manifest:
        """The context, when it is ``space``'s tenant's and has not expired; else ContextNotFound."""
        if not re.fullmatch(CONTEXT_ID_PATTERN, ctx_id):
            raise ContextNotFound(ctx_id)
        try:
            manifest = Manifest.read(self.store, manifest_key(ctx_id, space.tenant))
        except ObjectNotFound:
            raise ContextNotFound(ctx_id) from None
        if (
            manifest.tenant != space.tenant
            or manifest.expired(time.time())
            # another model's context (or chunk size) is not one a request here would reuse
            or manifest.fingerprint != self.fingerprint.hex
            or manifest.chunk_size != self.chunk_size
        ):
            raise ContextNotFound(ctx_id)  # the same answer as for an id never stored
        return manifest

    def list(self, space: KeySpace = PUBLIC) -> list[Manifest]:
        """This model's live contexts of ``space``'s tenant (reads that tenant's manifests only)."""
        now = time.time()
        manifests = [
            m
            for m in read_manifests(self.store, prefix=manifest_prefix(space.tenant))
            if m.fingerprint == self.fingerprint.hex and m.tenant == space.tenant and not m.expired(now)
        ]
        return sorted(manifests, key=lambda m: (m.created, m.id))

    def delete(self, ctx_id: str, space: KeySpace = PUBLIC) -> Manifest:
        manifest = self.get(ctx_id, space)
        self.remove(manifest)
        return manifest

    def remove(self, manifest: Manifest) -> int:
        return remove_context(self.store, manifest, self.pool)

    def forget_chunks(self, first_key: str, chunk_keys: set[str]) -> None:
        """Readers found these chunks missing or corrupt: the index stops listing them, so no reader
        plans with them again and a ``POST /contexts`` of the context encodes them anew. Best effort.

        A tail after a bad chunk stays listed: its own bytes are intact, no reader reaches it while
        its parent is missing, and it is whole again as soon as write-back (or a re-POST) stores
        the parent anew. Dropping it lost a stored context's tail to the collector for good."""
        try:
            self._update_index(first_key, lambda index: index.without(chunk_keys, orphaned_tails=False))
        except StorageError as exc:
            log.warning("could not drop bad chunks from prefix index %s: %s", first_key[:16], exc)

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
        index = PrefixIndex.read(store, key)
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


def read_manifests(
    store: ObjectStore, known: Mapping[str, Manifest] | None = None, prefix: str = MANIFEST_PREFIX
) -> list[Manifest]:
    """Every readable manifest under ``prefix`` (by default every tenant's; one tenant's:
    ``manifest_prefix(tenant)``): all models, expired or not.

    ``known``: manifests the caller read moments ago, by id; those still
    listed are taken from it instead of being read again."""
    found = []
    for info in store.list(prefix):
        ctx_id = context_id_from_manifest_key(info.key)
        if ctx_id is None:
            continue
        if known is not None and ctx_id in known:
            found.append(known[ctx_id])
            continue
        try:
            manifest = Manifest.read(store, info.key)
        except (ObjectNotFound, ManifestError) as exc:
            log.warning("skipping manifest %s: %s", info.key, exc)
            continue
        if info.key != manifest_key(manifest.id, manifest.tenant):
            log.warning("skipping manifest %s: it names another id or tenant", info.key)
            continue
        found.append(manifest)
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
    Only the same tenant's contexts can share its chunks (other tenants' keys
    are salted apart), so only its manifests are read.
    """
    store.delete(manifest_key(manifest.id, manifest.tenant))
    now = time.time()
    still_used = {
        key
        for other in read_manifests(store, known, manifest_prefix(manifest.tenant))
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
