"""Small combinators for ``concurrent.futures.Future``: the scheduler's stages hand each other
futures instead of waiting on threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

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


def when_all(futures: list[Future[Any]], fn: Callable[[], None]) -> None:
    """Call ``fn`` once every future is done: now if they are, else on the thread that ends the
    last of them."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    if not futures:
        fn()
    for future in futures:
        future.add_done_callback(one_done)


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
