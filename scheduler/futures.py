"""Small combinators for ``concurrent.futures.Future``: the scheduler's stages hand each other
futures instead of waiting on threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
U = TypeVar("U")


def done(value: T) -> Future[T]:
    """A future that already holds ``value``."""
    future: Future[T] = Future()
    future.set_result(value)
    return future


def then(future: Future[T], fn: Callable[[T], U]) -> Future[U]:
    """A future of ``fn`` of ``future``'s result (``fn`` runs on the thread that completes it)."""
    out: Future[U] = Future()

    def chained(finished: Future[T]) -> None:
        try:
            out.set_result(fn(finished.result()))
        except BaseException as exc:  # noqa: BLE001 - carried by the future
            out.set_exception(exc)

    future.add_done_callback(chained)
    return out


def once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, run by the first call only (any thread)."""
    lock = threading.Lock()
    called = [False]

    def call() -> None:
        with lock:
            if called[0]:
                return
            called[0] = True
        fn()

    return call
