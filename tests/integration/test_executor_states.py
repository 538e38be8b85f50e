"""The request executor's states, in process on the real default model: no thread waits on a
request's behalf.

A request waiting for KV memory, or for its sibling's prompt (``n`` choices),
holds a place in a queue, not a prepare thread: with one prepare thread and
more requests waiting than that, the thread still takes other work at once.
A request cancelled while it waits ends at once and lets the next one in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from engine import ModelRunner, load_model
from engine.sampling import SamplingParams
from scheduler.executor import RequestExecutor, RequestState
from scheduler.flag import Flag
from scheduler.generation import GenerationJob
from scheduler.kv_memory import KVMemory
from scheduler.step_loop import StepLoop
from tests.support.events import Collected

pytestmark = pytest.mark.slow

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
MAX_TOKENS = 64  # a few seconds of decoding: the waits below happen inside it


@pytest.fixture(scope="module")
def runner(model_dir) -> ModelRunner:
    return ModelRunner(load_model(str(model_dir)))


@pytest.fixture
def executor(runner) -> Iterator[RequestExecutor]:
    """Memory for one request at a time, and a single prepare thread."""
    loop = StepLoop(runner, max_num_seqs=4, max_batched_tokens=64)
    pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")
    memory = KVMemory(runner.kv_bytes(len(PROMPT) + MAX_TOKENS))
    # requests without stored KV never reach the store or the planner: only the chunk size and
    # the loader's learning are asked for
    contexts = SimpleNamespace(chunk_size=256)
    loader = SimpleNamespace(
        profile=SimpleNamespace(observe_prefill=lambda *args: None), observe_outcome=lambda *args: None
    )
    yield RequestExecutor(runner, contexts, loader, loop, memory, pool)  # type: ignore[arg-type]
    loop.stop()
    pool.shutdown()


def job(**extra) -> GenerationJob:
    return GenerationJob(
        prompt_ids=list(PROMPT),
        max_tokens=MAX_TOKENS,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        stops=[],
        kv=None,
        **extra,
    )


def start(executor: RequestExecutor, cancel: Flag | None = None, **extra) -> Collected:
    out = Collected()
    executor.start(job(**extra), out.emit, cancel or Flag())
    return out


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


def test_requests_waiting_for_memory_hold_no_thread(executor):
    first = start(executor)
    until(lambda: executor.count(RequestState.RUNNING) == 1)
    waiting = [start(executor) for _ in range(3)]  # more than the one prepare thread
    until(lambda: executor.memory.waiting == 3)
    assert executor.count(RequestState.WAITING) == 3 and not first.done.is_set()
    # the only prepare thread is free: nobody sits in the memory queue on it
    assert executor.pool.submit(lambda: "free").result(timeout=5) == "free"
    for out in (first, *waiting):
        assert out.done.wait(120)
        assert out.reason == "length" and len(out.tokens) == MAX_TOKENS
    until(lambda: all(executor.count(state) == 0 for state in RequestState))
    assert executor.memory.used == 0 and executor.memory.waiting == 0


def test_a_request_cancelled_while_waiting_ends_at_once_and_lets_the_next_in(executor):
    first = start(executor)
    until(lambda: executor.count(RequestState.RUNNING) == 1)
    cancel = Flag()
    doomed = start(executor, cancel)
    behind = start(executor)
    until(lambda: executor.memory.waiting == 2)
    cancel.set()
    assert doomed.done.wait(2) and doomed.reason == "abort" and not doomed.tokens
    assert executor.memory.waiting == 1 and not first.done.is_set()
    assert first.done.wait(120) and behind.done.wait(120)
    assert first.reason == behind.reason == "length"
    until(lambda: executor.memory.used == 0)


def test_a_choice_waits_for_its_siblings_prompt_without_a_thread(executor):
    ready = Flag()
    follower = start(executor, after=ready)
    assert executor.count(RequestState.WAITING) == 1
    assert executor.pool.submit(lambda: "free").result(timeout=5) == "free"
    time.sleep(0.2)
    assert not follower.done.is_set() and executor.count(RequestState.WAITING) == 1
    ready.set()  # the sibling's prompt is in memory (or the sibling ended)
    assert follower.done.wait(120) and follower.reason == "length"

    cancel, never = Flag(), Flag()
    gone = start(executor, cancel, after=never)
    cancel.set()
    assert gone.done.wait(2) and gone.reason == "abort"
    until(lambda: all(executor.count(state) == 0 for state in RequestState))
    assert executor.memory.used == 0
