"""Pre-encoded contexts: every chunk (and the tail) at every level, the prefix index, then the manifest.

The manifest is written last, so a context whose upload was interrupted is
never listed; its orphaned chunks still serve as a prefix cache once the
index lists them.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
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
)
from scheduler.manifest import Manifest
from scheduler.prefix import CONTEXT_ID_PATTERN, Fingerprint, chunk_keys, context_id, tail_key
from storage import ObjectNotFound, ObjectStore

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

    def context_id(self, token_ids: Sequence[int]) -> str:
        return context_id(self.fingerprint, token_ids)

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        return chunk_keys(self.fingerprint, token_ids, self.chunk_size)

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
    ) -> dict[str, int]:
        """Encode and store chunks ``first..len(keys)`` of ``kv`` (which starts at chunk 0), and
        ``tail``; then add them to the prefix index. Returns the bytes written per level."""
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
                chunks={k: ChunkEntry(objects=written[k]) for k in keys[first:] if k in written},
                tails={}
                if tail is None or tail.key not in written
                else {tail.key: TailEntry(objects=written[tail.key], parent=keys[-1], tokens=tail.tokens)},
            )
            self._update_index(keys[0], lambda index: index.merged(entries))
        return level_bytes

    def _update_index(self, first_key: str, change) -> None:
        """Read, change and write the index under ``first_key`` (a missing or bad one starts empty)."""
        key = index_key(first_key)
        try:
            index = PrefixIndex.from_bytes(self.store.get(key))
            if index.fingerprint != self.fingerprint.hex or index.chunk_size != self.chunk_size:
                raise PrefixIndexError("index of another model or chunk size")
        except (ObjectNotFound, PrefixIndexError) as exc:
            if not isinstance(exc, ObjectNotFound):
                log.warning("replacing unreadable prefix index %s: %s", key, exc)
            index = PrefixIndex(fingerprint=self.fingerprint.hex, chunk_size=self.chunk_size)
        index = change(index)
        if index.empty:
            self.store.delete(key)
        else:
            self.store.put(key, index.to_bytes())

    def save(
        self,
        token_ids: Sequence[int],
        kv: torch.Tensor,
        levels: Sequence[Level],
        compute_seconds: float,
    ) -> Manifest:
        """Encode and store each full chunk of ``kv`` and its tail at each level; the manifest goes last."""
        started = time.perf_counter()
        keys = self.keys(token_ids)
        tail = self.tail(token_ids, keys)
        level_bytes = self.save_chunks(keys, kv, levels, tail=tail)
        manifest = Manifest(
            id=self.context_id(token_ids),
            model=self.model_name,
            fingerprint=self.fingerprint.hex,
            chunk_size=self.chunk_size,
            tokens=len(token_ids),
            chunk_keys=keys,
            tail_key=None if tail is None else tail.key,
            tail_tokens=0 if tail is None else tail.tokens,
            level_bytes=level_bytes,
            created=int(time.time()),
            encode_seconds=round(compute_seconds + time.perf_counter() - started, 4),
        )
        self.store.put(manifest_key(manifest.id), manifest.to_bytes())
        return manifest

    def exists(self, ctx_id: str) -> bool:
        """Whether the manifest is stored (raises StorageError when the store cannot say)."""
        return self.store.head(manifest_key(ctx_id)) is not None

    def get(self, ctx_id: str) -> Manifest:
        if not re.fullmatch(CONTEXT_ID_PATTERN, ctx_id):
            raise ContextNotFound(ctx_id)
        try:
            data = self.store.get(manifest_key(ctx_id))
        except ObjectNotFound:
            raise ContextNotFound(ctx_id) from None
        return Manifest.from_bytes(data)

    def list(self) -> list[Manifest]:
        """This model's contexts; other models' and unreadable manifests are skipped."""
        manifests = []
        for info in self.store.list(MANIFEST_PREFIX):
            if context_id_from_manifest_key(info.key) is None:
                continue
            try:
                manifest = Manifest.from_bytes(self.store.get(info.key))
            except (ObjectNotFound, ManifestError) as exc:
                log.warning("skipping manifest %s: %s", info.key, exc)
                continue
            if manifest.fingerprint == self.fingerprint.hex:
                manifests.append(manifest)
        return sorted(manifests, key=lambda m: (m.created, m.id))

    def delete(self, ctx_id: str) -> Manifest:
        """Remove the context, and those of its chunks no other context uses.

        The manifest goes first, so the context disappears at once; then the
        index forgets the doomed chunks (so no reader plans with them), then
        their objects go. Chunks a shared prefix still needs are kept.
        """
        manifest = self.get(ctx_id)
        self.store.delete(manifest_key(ctx_id))
        still_used = {key for other in self.list() for key in other.stored_keys}
        doomed = {key for key in manifest.stored_keys if key not in still_used}
        if doomed and manifest.chunk_keys:
            self._update_index(manifest.chunk_keys[0], lambda index: index.without(doomed))
        objects = [info.key for key in sorted(doomed) for info in self.store.list(chunk_dir(key))]
        for future in [self.pool.submit(self.store.delete, key) for key in objects]:
            future.result()
        return manifest
