"""The scheduler's future combinators: ``then`` carries results and errors, ``once`` runs once."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from scheduler.futures import done, once, then


def test_done_holds_its_value():
    assert done(3).result(timeout=0) == 3


def test_then_runs_when_the_future_completes_and_carries_errors():
    source: Future[int] = Future()
    doubled = then(source, lambda x: 2 * x)
    assert not doubled.done()
    source.set_result(21)
    assert doubled.result(timeout=0) == 42

    failing = then(done(1), lambda x: x / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=0)
    broken: Future[int] = Future()
    passed_on = then(broken, lambda x: x + 1)
    broken.set_exception(KeyError("gone"))
    with pytest.raises(KeyError):
        passed_on.result(timeout=0)


def test_once_runs_on_the_first_call_of_many_threads():
    calls = []
    fn = once(lambda: calls.append(threading.get_ident()))
    threads = [threading.Thread(target=fn) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fn()
    assert len(calls) == 1


def test_when_all_calls_once_after_the_last_future_and_at_once_for_none():
    from concurrent.futures import Future

    from scheduler.futures import when_all

    calls: list[str] = []
    when_all([], lambda: calls.append("none"))
    assert calls == ["none"]
    futures: list[Future[int]] = [Future(), Future()]
    when_all(futures, lambda: calls.append("all"))
    futures[1].set_result(1)
    assert calls == ["none"]
    futures[0].set_result(0)
    assert calls == ["none", "all"]
