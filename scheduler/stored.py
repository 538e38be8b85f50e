"""What the store holds of a request's prefix: one index read, no chunk fetched yet."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from codec import Level, level_digest
from scheduler.errors import PrefixIndexError
from scheduler.index import ChunkEntry, PrefixIndex
from scheduler.layout import chunk_object_key, index_key
from scheduler.prefix import Fingerprint, tail_key
from storage import ObjectNotFound, ObjectStore, StorageError

log = logging.getLogger(__name__)

# How old a cached copy of a prefix index may be: a context deleted or collected by another
# gateway stops being planned with after this long (this gateway's own deletes: at once).
INDEX_MAX_AGE_S = 10.0


@dataclass(frozen=True)
class StoredChunk:
    """One stored run of tokens (a full chunk, or a context's tail) and the levels it has."""

    index: int
    key: str
    start: int  # first token
    tokens: int
    sizes: dict[str, int]  # level name -> bytes, only levels whose digest is this gateway's
    resident: dict[str, bool]  # level name -> already in this process's memory
    tail: bool = False
    expires: int | None = None  # Unix time after which the index no longer serves it (None: pinned)

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass
class StoredPrefix:
    chunks: list[StoredChunk] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.chunks[-1].end if self.chunks else 0


def find_stored_prefix(
    store: ObjectStore,
    fingerprint: Fingerprint,
    chunk_size: int,
    keys: Sequence[str],
    token_ids: Sequence[int],
    levels: Sequence[Level],
) -> StoredPrefix:
    """The leading chunks of ``keys`` (full chunks of ``token_ids``) stored at any of ``levels``,
    then the longest stored tail that ``token_ids`` continue with."""
    found = StoredPrefix()
    if not keys or not levels:
        return found
    now = time.time()
    try:
        index = PrefixIndex.read(store, index_key(keys[0]), INDEX_MAX_AGE_S)
    except ObjectNotFound:
        return found
    except StorageError as exc:
        log.warning("KV store unavailable while reading the prefix index: %s", exc)
        found.faults.append("store_unavailable")
        return found
    except PrefixIndexError as exc:
        log.warning("prefix index unreadable, recomputing: %s", exc)
        found.faults.append("corrupt_index")
        return found
    if index.fingerprint != fingerprint.hex or index.chunk_size != chunk_size:
        found.faults.append("corrupt_index")  # a key collision, or a forged index
        return found

    digests = {lv.name: level_digest(lv) for lv in levels}
    entries: list[tuple[str, int, int, ChunkEntry, bool]] = []
    for i, key in enumerate(keys):
        entry = index.chunks.get(key)
        if entry is None or not _usable(entry, digests, now):
            break
        entries.append((key, i * chunk_size, chunk_size, entry, False))
    if entries:
        parent, start = entries[-1][0], entries[-1][1] + chunk_size
        best = None
        for key, tail in index.tails.items():
            if (
                tail.parent != parent
                or start + tail.tokens > len(token_ids)
                or not _usable(tail, digests, now)
            ):
                continue
            if (best is None or tail.tokens > best[2]) and tail_key(
                parent, token_ids[start : start + tail.tokens]
            ) == key:
                best = (key, start, tail.tokens, tail, True)
        if best is not None:
            entries.append(best)

    object_keys = [
        chunk_object_key(key, name, digest)
        for key, _, _, entry, _ in entries
        for name, digest in digests.items()
        if entry.find(name, digest) is not None
    ]
    resident = dict(zip(object_keys, store.resident_many(object_keys), strict=True))
    for i, (key, start, tokens, entry, is_tail) in enumerate(entries):
        sizes = {n: o.bytes for n, d in digests.items() if (o := entry.find(n, d)) is not None}
        found.chunks.append(
            StoredChunk(
                index=i,
                key=key,
                start=start,
                tokens=tokens,
                sizes=sizes,
                resident={n: resident[chunk_object_key(key, n, digests[n])] for n in sizes},
                tail=is_tail,
                expires=entry.expires,
            )
        )
    return found


def _usable(entry: ChunkEntry, digests: dict[str, str], now: float) -> bool:
    """Live (no expired context's alone), and stored at a level this gateway reads."""
    return entry.live(now) and any(entry.find(name, digest) is not None for name, digest in digests.items())
