"""Object storage: moves opaque bytes between the gateway and a store.

Backends are chosen by URL scheme (``file://``, ``memory://``, ``s3://``);
nothing here knows what the bytes mean.
"""

from storage.base import ObjectInfo, ObjectStore
from storage.errors import ObjectNotFound, ObjectTooLarge, StorageError, StorageUnavailable
from storage.url import open_store

__all__ = [
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "ObjectTooLarge",
    "StorageError",
    "StorageUnavailable",
    "open_store",
]
