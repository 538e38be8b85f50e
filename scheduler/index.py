"""The per-prefix index: what is stored under one first chunk, and how big each object is.

One JSON object at ``kv/<first chunk key>/index.json`` lists every chunk and
context tail stored in chains that start with that chunk, with the bytes of
each of its objects: one per level name and digest of the level parameters
that wrote it. A request reads it with one GET and can then plan its whole
prefix (level per chunk, or text) before fetching anything. A missing index
is a miss.

Version 2 lists a chunk's objects by (level, digest), so gateways whose level
tables give one name different parameters (a table being rolled out) each
find their own objects. Version 1 kept one object per level name, and the
last writer's digest hid the other's; it is still read. A version-1 gateway
refuses a version-2 index and, when it next writes, replaces it: during a
software roll-out the two versions miss each other's entries, never read
wrong bytes.

Writers merge their entries into the index (read, union, write). Two writers
racing on the same first chunk can lose one's entries; the cost is a later
miss for those chunks (they are recomputed, and write-back stores them again),
never wrong bytes: every object is still checked when it is read.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from scheduler.errors import PrefixIndexError
from storage import ObjectStore, ObjectTooLarge

INDEX_VERSION = 2
MAX_INDEX_BYTES = 8 * 2**20  # bounds what a reader parses; ~20K entries
MAX_ENTRIES = 16384
MAX_OBJECTS = 64  # per chunk: level names x the tables that wrote them

_HEX64 = r"^[0-9a-f]{64}$"
_HEX16 = r"^[0-9a-f]{16}$"
_LEVEL = r"^[A-Za-z0-9_-]{1,64}$"


class StoredObject(BaseModel):
    """One encoded object of a chunk: ``kv/<chunk key>/<level>.<digest>``, ``bytes`` long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: str = Field(pattern=_LEVEL)
    digest: str = Field(pattern=_HEX16)
    bytes: int = Field(gt=0)


class ChunkEntry(BaseModel):
    """A full chunk: its objects, at most one per (level, digest), and until when readers may use it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    objects: tuple[StoredObject, ...] = Field(min_length=1, max_length=MAX_OBJECTS)
    # Unix time: the latest expiry of the contexts that stored it; None: pinned, or written back
    expires: int | None = None

    def live(self, now: float) -> bool:
        return self.expires is None or now < self.expires

    def find(self, level: str, digest: str) -> StoredObject | None:
        """The object of level ``level`` written with parameters of digest ``digest``, if listed."""
        return next((o for o in self.objects if o.level == level and o.digest == digest), None)

    @property
    def levels(self) -> set[str]:
        return {o.level for o in self.objects}

    @model_validator(mode="after")
    def _distinct(self) -> ChunkEntry:
        if len({(o.level, o.digest) for o in self.objects}) != len(self.objects):
            raise ValueError("an object is listed twice")
        return self


class TailEntry(ChunkEntry):
    """A context's trailing partial chunk, following the full chunk ``parent``."""

    parent: str = Field(pattern=_HEX64)
    tokens: int = Field(gt=0)


class PrefixIndex(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(INDEX_VERSION, ge=INDEX_VERSION, le=INDEX_VERSION)
    fingerprint: str = Field(pattern=_HEX64)
    chunk_size: int = Field(gt=0)
    chunks: dict[str, ChunkEntry] = {}
    tails: dict[str, TailEntry] = {}

    @model_validator(mode="before")
    @classmethod
    def _from_version_1(cls, data: object) -> object:
        """Version 1 listed a chunk's objects as ``{level: {digest, bytes}}``."""
        if not isinstance(data, dict) or data.get("version") != 1:
            return data

        def entry(e: object) -> object:
            if isinstance(e, dict) and isinstance(e.get("objects"), dict):
                objects = [{"level": k, **v} if isinstance(v, dict) else v for k, v in e["objects"].items()]
                return {**e, "objects": objects}
            return e

        return {
            **data,
            "version": INDEX_VERSION,
            **{
                part: {k: entry(e) for k, e in data[part].items()}
                for part in ("chunks", "tails")
                if isinstance(data.get(part), dict)
            },
        }

    @model_validator(mode="after")
    def _bounded(self) -> PrefixIndex:
        import re

        if len(self.chunks) + len(self.tails) > MAX_ENTRIES:
            raise ValueError(f"more than {MAX_ENTRIES} entries")
        for key in (*self.chunks, *self.tails):
            if not re.fullmatch(_HEX64, key):
                raise ValueError(f"bad chunk key {key[:80]!r}")
        for tail in self.tails.values():
            if tail.tokens >= self.chunk_size:
                raise ValueError("a tail must be shorter than a chunk")
        return self

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixIndex:
        if len(data) > MAX_INDEX_BYTES:
            raise PrefixIndexError(f"index of {len(data)} bytes exceeds {MAX_INDEX_BYTES}")
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise PrefixIndexError(f"invalid prefix index: {exc.errors()[0]['msg']}") from exc

    @classmethod
    def read(cls, store: ObjectStore, key: str, max_age_s: float | None = None) -> PrefixIndex:
        """The index at ``key``, never downloading more than ``MAX_INDEX_BYTES``; ``max_age_s``:
        read with ``get_fresh``. Raises ObjectNotFound, PrefixIndexError (too large, invalid) or
        StorageError."""
        try:
            if max_age_s is None:
                data = store.get(key, MAX_INDEX_BYTES)
            else:
                data = store.get_fresh(key, max_age_s, MAX_INDEX_BYTES)
        except ObjectTooLarge as exc:
            raise PrefixIndexError(str(exc)) from None
        return cls.from_bytes(data)

    def merged(self, other: PrefixIndex) -> PrefixIndex:
        """This index with ``other``'s entries added (an entry's objects are united per level and
        digest, ``other``'s sizes winning, and it lives as long as the longer-lived of the two)."""

        def union(old: ChunkEntry | None, new: ChunkEntry) -> ChunkEntry:
            if old is None:
                return new
            objects = {(o.level, o.digest): o for o in (*old.objects, *new.objects)}
            kept = tuple(objects.values())[-MAX_OBJECTS:]  # past the bound, the oldest go unlisted
            return new.model_copy(update={"objects": kept, "expires": later(old.expires, new.expires)})

        chunks = dict(self.chunks)
        for key, entry in other.chunks.items():
            chunks[key] = union(chunks.get(key), entry)
        tails = dict(self.tails)
        for key, tail in other.tails.items():
            tails[key] = union(tails.get(key), tail)  # type: ignore[assignment]
        return self.model_copy(update={"chunks": chunks, "tails": tails})

    def with_expiry(self, expires: dict[str, int | None]) -> PrefixIndex:
        """This index with the entries in ``expires`` living until the given times."""
        return self.model_copy(
            update={
                "chunks": {k: _expiring(k, v, expires) for k, v in self.chunks.items()},
                "tails": {k: _expiring(k, v, expires) for k, v in self.tails.items()},
            }
        )

    def without(self, keys: set[str], *, orphaned_tails: bool = True) -> PrefixIndex:
        """This index less the chunks and tails in ``keys``, and (``orphaned_tails``) the tails
        whose parent is in ``keys``."""
        chunks = {k: v for k, v in self.chunks.items() if k not in keys}
        tails = {
            k: v for k, v in self.tails.items() if k not in keys and not (orphaned_tails and v.parent in keys)
        }
        return self.model_copy(update={"chunks": chunks, "tails": tails})

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.tails


def later(a: int | None, b: int | None) -> int | None:
    """The later of two expiries, where None (never) is the latest."""
    return None if a is None or b is None else max(a, b)


def _expiring(key: str, entry: ChunkEntry, expires: dict[str, int | None]) -> ChunkEntry:
    if key not in expires or expires[key] == entry.expires:
        return entry
    return entry.model_copy(update={"expires": expires[key]})
