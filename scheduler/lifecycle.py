"""Garbage collection and the store's size cap: what ``python -m app gc`` and the gateway's sweep run.

One pass (``StoreCollector.collect``):

1. Expired contexts lose their manifests (they were already neither served
   nor listed: readers check the expiry in the manifest and in the index).
2. Chunk directories that no live manifest lists are collected once every
   object in them is older than the grace period. These are write-back
   chunks, the chunks of interrupted uploads and of expired contexts. The
   grace period protects a context that is being written: its chunks land
   before its manifest does.
3. Each surviving prefix index forgets the collected chunks (before their
   objects go, so no reader plans with them) and takes its entries' expiry
   from the live contexts that list them.
4. With a size cap, whole contexts are evicted until the store fits:
   contexts with a TTL first, least recently used first, and pinned ones only
   when the cap cannot be met without them. Recency is the later of a
   context's creation and the last load of its prefix (``ContextStore.touch``).

Collection works on the whole store, every model and tenant: a chunk is live
while any live manifest lists it. Two collectors racing do no harm (deletes of
missing objects are no-ops); a collector racing a writer is what the grace
period is for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.contexts import read_manifests, remove_context
from scheduler.errors import PrefixIndexError
from scheduler.index import PrefixIndex, later
from scheduler.layout import CHUNK_PREFIX, MANIFEST_PREFIX, chunk_key_of, index_key, manifest_key, used_key
from scheduler.manifest import Manifest
from storage import ObjectInfo, ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)


@dataclass
class CollectReport:
    expired_contexts: int = 0
    collected_chunks: int = 0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    evicted_contexts: list[str] = field(default_factory=list)
    evicted_bytes: int = 0
    store_bytes: int = 0  # after the pass
    seconds: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return dict(vars(self))


class StoreCollector:
    def __init__(self, store: ObjectStore, grace_s: float, max_bytes: int | None = None) -> None:
        self.store = store
        self.grace_s = grace_s
        self.max_bytes = max_bytes

    def collect(self, now: float | None = None) -> CollectReport:
        started = time.perf_counter()
        now = time.time() if now is None else now
        report = CollectReport()
        manifests = read_manifests(self.store)
        live = [m for m in manifests if not m.expired(now)]
        for manifest in manifests:
            if manifest.expired(now):
                self.store.delete(manifest_key(manifest.id, manifest.tenant))
                report.expired_contexts += 1

        dirs = self._chunk_dirs()
        expiry = _expiry_by_key(live)
        doomed = {
            key
            for key, objects in dirs.items()
            if key not in expiry and now - max(o.modified for o in objects) >= self.grace_s
        }
        self._fix_indexes(dirs, doomed, expiry)
        for key in sorted(doomed):
            for info in dirs.pop(key):
                self.store.delete(info.key)
                report.deleted_objects += 1
                report.deleted_bytes += info.size
        report.collected_chunks = len(doomed)

        report.store_bytes = sum(o.size for objects in dirs.values() for o in objects) + sum(
            o.size for o in self.store.list(MANIFEST_PREFIX)
        )
        if self.max_bytes is not None and report.store_bytes > self.max_bytes:
            self._evict(live, dirs, report)
        report.seconds = round(time.perf_counter() - started, 3)
        return report

    def _chunk_dirs(self) -> dict[str, list[ObjectInfo]]:
        dirs: dict[str, list[ObjectInfo]] = defaultdict(list)
        for info in self.store.list(CHUNK_PREFIX):
            key = chunk_key_of(info.key)
            if key is not None:
                dirs[key].append(info)
        return dict(dirs)

    def _fix_indexes(
        self, dirs: dict[str, list[ObjectInfo]], doomed: set[str], expiry: dict[str, int | None]
    ) -> None:
        """Every index outside ``doomed`` forgets the doomed chunks and takes the live expiries."""
        for first, objects in dirs.items():
            if first in doomed or not any(o.key == index_key(first) for o in objects):
                continue
            key = index_key(first)
            try:
                index = PrefixIndex.read(self.store, key)
            except (ObjectNotFound, PrefixIndexError):
                continue  # gone meanwhile, or unreadable (readers treat it as a miss, writers replace it)
            listed = {**index.chunks, **index.tails}
            fixed = index.without(doomed).with_expiry({k: v for k, v in expiry.items() if k in listed})
            if fixed == index:
                continue
            if fixed.empty:
                self.store.delete(key)
            else:
                self.store.put(key, fixed.to_bytes())

    def _evict(self, live: list[Manifest], dirs: dict[str, list[ObjectInfo]], report: CollectReport) -> None:
        def order(m: Manifest) -> tuple[bool, float]:
            """Contexts with a TTL before pinned ones; then least recently used first."""
            used = 0.0
            if m.chunk_keys:
                marker = used_key(m.chunk_keys[0])
                used = max(
                    (o.modified for o in dirs.get(m.chunk_keys[0], []) if o.key == marker), default=0.0
                )
            return (m.expires is None, max(float(m.created), used))

        cap = self.max_bytes
        assert cap is not None
        known = {m.id: m for m in live}  # read at the start of this pass: each removal lists, not re-reads
        for manifest in sorted(live, key=order):
            if report.store_bytes <= cap:
                break
            freed = remove_context(self.store, manifest, known=known)
            report.evicted_contexts.append(manifest.id)
            report.evicted_bytes += freed
            report.store_bytes -= freed
            log.info("evicted context %s (%d bytes) to keep the store under its cap", manifest.id, freed)


def _expiry_by_key(live: list[Manifest]) -> dict[str, int | None]:
    """Each chunk key a live manifest lists, with the latest expiry among them (None: pinned)."""
    expiry: dict[str, int | None] = {}
    for manifest in live:
        for key in manifest.stored_keys:
            expiry[key] = later(expiry[key], manifest.expires) if key in expiry else manifest.expires
    return expiry


class PeriodicTask:
    """Runs ``task`` every ``interval_s`` on a thread of its own (named ``name``), until ``stop``.
    A failing run is logged and the next one runs as planned."""

    def __init__(self, task: Callable[[], object], interval_s: float, name: str) -> None:
        self.task = task
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.task()
            except Exception:
                log.exception("%s failed", self._thread.name)
