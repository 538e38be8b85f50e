"""The object-store interface that every backend implements.

Keys are '/'-separated relative paths made of ``[A-Za-z0-9._-]`` segments; the
store treats values as opaque bytes. Batched calls have sequential defaults
that backends with real round trips override.

Every whole-object read takes a ``limit``: an object larger than that raises
``ObjectTooLarge`` from its size (Content-Length, a file's size) before its body
is read, and a body that grows past it while streaming is cut off there. So
bytes someone else wrote cannot make a reader download or hold more than it
asked for. Callers pass the largest object they can parse; the default is a
backstop, not a size anyone should rely on.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from storage.errors import ObjectNotFound, ObjectTooLarge

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")


def check_key(key: str) -> str:
    """Reject keys that could escape a prefix or a directory."""
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") or not _KEY_SEGMENT.match(p) for p in parts):
        raise ValueError(f"invalid object key: {key!r}")
    return key


DEFAULT_LIMIT = 256 * 2**20


def check_size(key: str, size: int, limit: int) -> None:
    if size > limit:
        raise ObjectTooLarge(f"{key}: {size} bytes, over the reader's limit of {limit}")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float = 0.0  # when the object was last written, Unix seconds (garbage collection's grace)


class ObjectStore(abc.ABC):
    """A flat namespace of immutable-ish byte objects."""

    url: str
    # what a read is expected to move per second before any was measured (None: unknown, a link);
    # planners price the first fetches of a process with it
    prior_bytes_per_second: float | None = None

    @abc.abstractmethod
    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        """Whole object; raises ObjectNotFound, or ObjectTooLarge past ``limit`` bytes."""

    def get_into(self, key: str, buffer: memoryview, limit: int = DEFAULT_LIMIT) -> bytes | memoryview:
        """Like ``get``, reading into ``buffer`` where the store can and the object fits it: the
        result is then a view of ``buffer``. Otherwise (the default) the bytes are wherever the
        store has them, ``buffer`` unused."""
        return self.get(key, limit)

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer at the end of the object)."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write atomically: readers see the old object, or the whole new one."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """Size of the object, or None when it does not exist."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, in key order."""

    def get_many(self, keys: Iterable[str], limit: int = DEFAULT_LIMIT) -> list[bytes | None]:
        """Objects in order, None for the missing ones; ``limit`` applies to each."""
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.get(key, limit))
            except ObjectNotFound:
                out.append(None)
        return out

    def get_fresh(self, key: str, max_age_s: float, limit: int = DEFAULT_LIMIT) -> bytes:
        """Like ``get``, but a copy cached in this process may be at most ``max_age_s`` old: for
        objects that other processes rewrite or delete (a prefix index), so a cache in front of the
        store serves their deletes within that bound. Stores without a cache read through."""
        return self.get(key, limit)

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return [self.head(k) is not None for k in keys]

    def resident_many(self, keys: Iterable[str]) -> list[bool]:
        """Whether each object is in this process's memory (a read costs no transfer).

        Planners use it to price a fetch; it is a hint, never a promise that a
        later ``get`` succeeds. Stores that always go over a link say False.
        """
        return [False for _ in keys]

    def close(self) -> None:
        """Release connections; the default has nothing to release."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
