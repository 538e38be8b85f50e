"""Where things live in the object store.

    kv/<chunk key>/<level>.<level digest>   one encoded chunk (or context tail) at one level
    kv/<first chunk key>/index.json         what is stored under that first chunk (sizes per level)
    kv/<first chunk key>/used               empty; its write time is when a request last loaded
                                            a prefix that starts there (eviction's recency)
    contexts/<owner>/<context id>.json      a pre-encoded context's manifest, written last; the
                                            owner is its tenant's id, or ``public`` without tenants
    gc/lease.json                           which replica runs the periodic collection, and until when

One object per (chunk, level) lets a reader fetch exactly the level it picked
with a plain GET. The level digest in the name keeps gateways whose level
tables give one name different parameters from ever reading each other's
bytes under that name. The index lets a reader plan a whole prefix (which
levels exist, how many bytes each) from one GET, before fetching any chunk.
A tenant's manifests share a prefix, so listing its contexts lists and reads
only its own.
"""

from __future__ import annotations

CHUNK_PREFIX = "kv/"
MANIFEST_PREFIX = "contexts/"
_MANIFEST_SUFFIX = ".json"
PUBLIC_OWNER = "public"  # contexts of no tenant; tenant ids are 32 hex digits, never this
INDEX_NAME = "index.json"
USED_NAME = "used"
COLLECTION_LEASE_KEY = "gc/lease.json"


def object_name(level: str, digest: str) -> str:
    """The last path segment of a chunk object: which level, encoded by which parameters."""
    return f"{level}.{digest}"


def chunk_object_key(chunk_key: str, level: str, digest: str) -> str:
    return f"{CHUNK_PREFIX}{chunk_key}/{object_name(level, digest)}"


def chunk_dir(chunk_key: str) -> str:
    """Prefix of every object stored for one chunk (all levels)."""
    return f"{CHUNK_PREFIX}{chunk_key}/"


def index_key(first_chunk_key: str) -> str:
    return f"{CHUNK_PREFIX}{first_chunk_key}/{INDEX_NAME}"


def used_key(first_chunk_key: str) -> str:
    return f"{CHUNK_PREFIX}{first_chunk_key}/{USED_NAME}"


def chunk_key_of(object_key: str) -> str | None:
    """The chunk key whose directory ``object_key`` is in (``kv/<chunk key>/...``)."""
    if not object_key.startswith(CHUNK_PREFIX):
        return None
    key, sep, _ = object_key[len(CHUNK_PREFIX) :].partition("/")
    return key if sep else None


def manifest_prefix(tenant: str | None) -> str:
    """Prefix of every manifest of ``tenant`` (None: contexts of no tenant)."""
    return f"{MANIFEST_PREFIX}{tenant or PUBLIC_OWNER}/"


def manifest_key(context_id: str, tenant: str | None = None) -> str:
    return f"{manifest_prefix(tenant)}{context_id}{_MANIFEST_SUFFIX}"


def context_id_from_manifest_key(key: str) -> str | None:
    """The context id of ``contexts/<owner>/<id>.json``; None for any other key."""
    if not (key.startswith(MANIFEST_PREFIX) and key.endswith(_MANIFEST_SUFFIX)):
        return None
    owner, sep, name = key[len(MANIFEST_PREFIX) : -len(_MANIFEST_SUFFIX)].partition("/")
    return name if sep and owner and name and "/" not in name else None
