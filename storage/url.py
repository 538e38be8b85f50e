"""Pick a backend from a store URL, optionally behind an in-memory LRU."""

from __future__ import annotations

from urllib.parse import urlparse

from storage.base import ObjectStore


def open_store(url: str, *, cache_bytes: int = 0) -> ObjectStore:
    """``file:///abs/dir``, ``memory://`` or ``s3://bucket/prefix``.

    ``cache_bytes > 0`` puts an LRUCacheStore of that many bytes in front.
    """
    if cache_bytes < 0:
        raise ValueError(f"cache_bytes must be >= 0, got {cache_bytes}")
    store = _open_backend(url)
    if cache_bytes:
        from storage.tiered import LRUCacheStore

        return LRUCacheStore(store, cache_bytes)
    return store


def _open_backend(url: str) -> ObjectStore:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        from storage.local import LocalStore

        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URLs take an absolute path, got {url!r}")
        return LocalStore(parsed.path)
    if parsed.scheme == "memory":
        from storage.memory import MemoryStore

        return MemoryStore(url)
    if parsed.scheme == "s3":
        from storage.s3 import S3Store

        return S3Store.from_url(url)
    raise ValueError(f"unsupported store URL {url!r}: use file://, memory:// or s3://")
