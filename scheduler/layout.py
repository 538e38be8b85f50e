"""Where things live in the object store.

    kv/<chunk key>/<level>      one encoded chunk at one quality level
    contexts/<context id>.json  a pre-encoded context's manifest, written last

One object per (chunk, level) lets a reader fetch exactly the level it picked
with a plain GET, and lets a level be added to a stored chunk later without
rewriting the others.
"""

from __future__ import annotations

CHUNK_PREFIX = "kv/"
MANIFEST_PREFIX = "contexts/"
_MANIFEST_SUFFIX = ".json"


def chunk_object_key(chunk_key: str, level: str) -> str:
    return f"{CHUNK_PREFIX}{chunk_key}/{level}"


def manifest_key(context_id: str) -> str:
    return f"{MANIFEST_PREFIX}{context_id}{_MANIFEST_SUFFIX}"


def context_id_from_manifest_key(key: str) -> str | None:
    if key.startswith(MANIFEST_PREFIX) and key.endswith(_MANIFEST_SUFFIX):
        return key[len(MANIFEST_PREFIX) : -len(_MANIFEST_SUFFIX)]
    return None
