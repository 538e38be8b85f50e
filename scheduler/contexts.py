"""Pre-encoded contexts: write every chunk at every level, then the manifest.

The manifest is written last, so a context whose upload was interrupted is
never listed; its orphaned chunks still serve as a prefix cache.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from codec import Level, encode_chunk
from scheduler.errors import ContextNotFound, ManifestError
from scheduler.layout import MANIFEST_PREFIX, chunk_object_key, context_id_from_manifest_key, manifest_key
from scheduler.manifest import Manifest
from scheduler.prefix import CONTEXT_ID_PATTERN, Fingerprint, chunk_keys, context_id
from storage import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)


class ContextStore:
    def __init__(
        self,
        store: ObjectStore,
        fingerprint: Fingerprint,
        model_name: str,
        chunk_size: int,
        pool: ThreadPoolExecutor,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.model_name = model_name
        self.chunk_size = chunk_size
        self.pool = pool

    def context_id(self, token_ids: Sequence[int]) -> str:
        return context_id(self.fingerprint, token_ids)

    def keys(self, token_ids: Sequence[int]) -> list[str]:
        return chunk_keys(self.fingerprint, token_ids, self.chunk_size)

    def save_chunks(
        self, keys: Sequence[str], kv: torch.Tensor, levels: Sequence[Level], first: int = 0
    ) -> dict[str, int]:
        """Encode and store chunks ``first..len(keys)`` of ``kv`` (which starts at chunk 0).

        Returns the bytes written per level. No manifest: the chunks serve as a
        prefix cache, which is all the write-back path needs.
        """
        level_bytes = {level.name: 0 for level in levels}
        uploads = []
        for index in range(first, len(keys)):
            chunk = kv[:, :, :, index * self.chunk_size : (index + 1) * self.chunk_size]
            for level in levels:
                data = encode_chunk(chunk, level)
                level_bytes[level.name] += len(data)
                uploads.append(
                    self.pool.submit(self.store.put, chunk_object_key(keys[index], level.name), data)
                )
        for upload in uploads:
            upload.result()  # re-raises the first StorageError
        return level_bytes

    def save(
        self,
        token_ids: Sequence[int],
        kv: torch.Tensor,
        levels: Sequence[Level],
        compute_seconds: float,
    ) -> Manifest:
        """Encode and store each full chunk of ``kv`` at each level; the manifest goes last."""
        started = time.perf_counter()
        keys = self.keys(token_ids)
        level_bytes = self.save_chunks(keys, kv, levels)
        manifest = Manifest(
            id=self.context_id(token_ids),
            model=self.model_name,
            fingerprint=self.fingerprint.hex,
            chunk_size=self.chunk_size,
            tokens=len(token_ids),
            chunk_keys=keys,
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

        The manifest goes first, so the context disappears at once; chunks a
        shared prefix still needs are kept.
        """
        manifest = self.get(ctx_id)
        self.store.delete(manifest_key(ctx_id))
        still_used = {key for other in self.list() for key in other.chunk_keys}
        doomed = [
            chunk_object_key(key, level)
            for key in manifest.chunk_keys
            if key not in still_used
            for level in manifest.level_bytes
        ]
        for future in [self.pool.submit(self.store.delete, key) for key in doomed]:
            future.result()
        return manifest
