"""Exceptions raised by every storage backend."""


class StorageError(Exception):
    """A store operation failed (the object may or may not exist)."""


class ObjectNotFound(StorageError):
    """The key does not exist in the store."""


class ObjectTooLarge(StorageError):
    """The object is larger than the caller's limit; nothing past the limit was read."""


class StorageUnavailable(StorageError):
    """The store could not be reached, or refused us (network, credentials, bucket)."""
