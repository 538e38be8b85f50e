"""The codec gate's background side: encodes wait while interactive work runs, never forever."""

from __future__ import annotations

import threading
import time

from scheduler.codec_gate import BackgroundGate, CodecGate


def enter_in_thread(gate: BackgroundGate) -> tuple[threading.Thread, threading.Event, list[float]]:
    entered, when = threading.Event(), []

    def run() -> None:
        with gate:
            when.append(time.monotonic())
            entered.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, entered, when


def test_an_encode_waits_for_interactive_work_to_end_then_runs():
    busy = threading.Event()
    busy.set()
    gate = CodecGate(interactive=busy.is_set)
    thread, entered, _ = enter_in_thread(BackgroundGate(gate, max_wait_s=30.0))
    assert not entered.wait(0.3)  # a generation is on the model: the encode holds back
    assert not gate.active
    busy.clear()
    assert entered.wait(5.0)
    thread.join(5.0)
    assert not gate.active


def test_an_encode_is_never_starved_and_interactive_decodes_do_not_wait():
    gate = CodecGate(interactive=lambda: True)  # interactive work that never ends
    started = time.monotonic()
    thread, entered, when = enter_in_thread(BackgroundGate(gate, max_wait_s=0.2))
    assert entered.wait(5.0)
    thread.join(5.0)
    assert when[0] - started >= 0.2
    with gate:  # a prefix load's decode takes the gate as it is
        assert gate.active


def test_the_gate_is_still_one_operation_at_a_time_for_background_work():
    gate = CodecGate()
    background = gate.background()
    with gate:
        thread, entered, _ = enter_in_thread(background)
        assert not entered.wait(0.2)  # held by the decode above
    assert entered.wait(5.0)
    thread.join(5.0)


def test_before_runs_under_the_gate_on_the_entering_thread_and_a_failure_releases_it():
    calls: list[tuple[bool, int]] = []
    gate = CodecGate()
    gate.before = lambda: calls.append((gate.active, threading.get_ident()))
    with gate:
        pass
    with gate.background():
        pass
    assert calls == [(True, threading.get_ident())] * 2

    def fail() -> None:
        raise RuntimeError("no threads")

    gate.before = fail
    try:
        with gate:
            raise AssertionError("the body must not run")
    except RuntimeError:
        pass
    assert not gate.active
    gate.before = lambda: None
    thread, entered, _ = enter_in_thread(gate.background())
    assert entered.wait(5.0)  # the failed entry released the lock
    thread.join(5.0)
