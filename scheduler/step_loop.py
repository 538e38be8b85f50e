"""The model thread: a step loop that batches every running sequence into one forward pass per step.

Each step runs one decode token for every running generation, and fills the
rest of a token budget (``max_batched_tokens``) with prefill: prompt chunks of
generations, text chunks of a loading prefix, and pre-encodes (in the manner
of vLLM's chunked prefill). The budget bounds how long one step, and so one
inter-token gap of every running stream, can take; a long prompt or a 4K
pre-encode is spread over many steps instead of stalling them all.

Prefill is served interactive first (generations' prompts and their prefix's
text chunks, oldest first), then background work (pre-encodes). With nothing
decoding, interactive prefill may take up to ``IDLE_PREFILL_TOKENS`` per step:
there is no stream to stall, and each step's fixed cost (a pass over the
weights) is then spread over more tokens. Background work waits for
interactive work: alone it takes at most ``BACKGROUND_STEP_TOKENS`` a step
(``BACKGROUND_NEAR_STEP_TOKENS`` within ``INTERACTIVE_NEAR_S`` of interactive
work, when a closed-loop client's next request is likely on its way), so a
request that arrives during a pre-encode waits at most one such step; beside
interactive work it rides along with ``MIN_PREFILL_TOKENS`` once every
``BACKGROUND_AGING_S``, so a steady stream of chats slows pre-encodes but
never stops them.
(Filling every step up to the budget with pre-encode tokens, 512 with nothing
decoding, made a short chat 9x slower than idle under a burst of pre-encodes
on 2 cores: ``benchmarks/encode_fairness.py``.)

Nothing but the model runs here. A generation arrives with its prefix already
loaded (``submit``), or as a load in progress (``submit_loading``): a future
the loop checks before every step, which gives the generation once its
prefix is in (the loader's text chunks are prefilled here meanwhile). At most
``max_num_seqs`` generations are running, the rest wait in the order their
loads ended, holding their KV memory but no batch slot. Cancellation is
checked before every step.

A step of fresh prompts only (nothing decoding, no prompt half prefilled, no
text chunk of a load to run) may wait for loads still in flight: for at most
as long as that step would take beside them (``HOLD_CONTENTION`` times the
profile's ``prefill_seconds``, and never more than ``MAX_HOLD_S``). A burst of
questions on stored prefixes then shares one step, where the first load to
end used to get a step of its own: run beside the other loads on the same
cores, that step took 0.22-0.33 s instead of 0.10-0.12, and every other
question waited for it (``benchmarks/stored_burst.py``). Holding for the
profile's time alone (1x) ended before most loads and gained nothing. While
the step loop holds, the codec may take every core (``model_busy`` is False).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from engine import ModelRunner
from engine.ragged import Segment
from engine.sampling import sample_batch
from scheduler.futures import done
from scheduler.generation import Generation

log = logging.getLogger(__name__)
T = TypeVar("T")

IDLE_PREFILL_TOKENS = 512
BACKGROUND_STEP_TOKENS = 128
# Interactive work seen in the last INTERACTIVE_NEAR_S: a closed-loop client's next request is
# probably on its way, so background steps shrink (a request waits for at most one of them)
INTERACTIVE_NEAR_S = 1.0
BACKGROUND_NEAR_STEP_TOKENS = 32
BACKGROUND_AGING_S = 0.5  # beside interactive work, background prefill gets a step's share this often
MIN_PREFILL_TOKENS = 16  # prompts progress however many streams decode
MAX_HOLD_S = 0.25  # the longest a step of fresh prompts waits for loads in flight
# a step run beside loads took about this many times the profile's (idle) time: 0.33 s against
# 0.12, 0.22 against 0.10 (stored_burst, 2 cores)
HOLD_CONTENTION = 3.0


class LoopStopped(RuntimeError):
    """The step loop shut down before the work was done."""


@dataclass(eq=False)
class PrefillTask:
    """Prefill that is not a generation's prompt: KV only, no logits."""

    kv: torch.Tensor
    start: int
    token_ids: list[int]
    background: bool
    cancel: threading.Event | None
    # another task whose KV this one reads: it starts when that one is prefilled, and is not run
    # (its future False) when that one was not
    after: Future[bool] | None = None
    arrived: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    start_offset: int = 0  # tokens of ``token_ids`` already prefilled
    # set when the task ends: whether every token was prefilled (False: cancelled), or its error
    future: Future[bool] = field(default_factory=Future)

    def finish(self) -> None:
        self.done.set()
        if self.future.done():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.remaining == 0)

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.start_offset

    def segment(self, budget: int) -> Segment:
        n = min(budget, self.remaining)
        at = self.start + self.start_offset
        return Segment(self.kv, at, self.token_ids[self.start_offset : self.start_offset + n], "none")


@dataclass
class StepStats:
    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    busy_s: float = 0.0
    holds: int = 0  # steps that waited for loads in flight
    held_s: float = 0.0


class StepLoop:
    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int,
        max_batched_tokens: int,
        on_step: Callable[[int, int], None] = lambda running, waiting: None,
        torch_threads: Callable[[], int] | None = None,
    ) -> None:
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.on_step = on_step  # gauges: running and waiting generations
        self.torch_threads = torch_threads  # asked before each step: torch threads to use for it
        # the cost profile's prediction of a prefill (tokens, cached tokens before them) in seconds,
        # wired once the profile exists (app/build.py); None: a step never waits for loads
        self.prefill_seconds: Callable[[int, int], float] | None = None
        self._holding = False  # the model thread waits for loads in flight (``_hold_for_loads``)
        self.stats = StepStats()
        self._cond = threading.Condition()
        self._incoming: deque[Generation] = deque()  # submitted, not yet seen by the loop
        # loads in progress: each gives its generation, or None when its request ended before
        self._loading: list[Future[Generation | None]] = []
        self._waiting: deque[Generation] = deque()  # loaded, waiting for a batch slot
        self._running: list[Generation] = []
        self._tasks: list[PrefillTask] = []
        self._background_at = 0.0  # when background prefill last rode along with interactive work
        self._interactive_at = -INTERACTIVE_NEAR_S  # when a step last had interactive work
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._calling = False  # the model thread is running calls taken from ``_calls``
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="model", daemon=True)
        self._thread.start()

    # -- other threads ----------------------------------------------------------------------------

    def submit(self, generation: Generation) -> None:
        with self._cond:
            if self._stopping:
                raise LoopStopped("the server is shutting down")
            self._incoming.append(generation)
            self._cond.notify()

    def submit_loading(self, load: Future[Generation | None]) -> None:
        """A request whose prefix is loading: its generation runs once ``load`` gives it (None:
        the request ended while loading, and its owner has told the client so)."""
        with self._cond:
            if self._stopping:
                raise LoopStopped("the server is shutting down")
            self._loading.append(load)
        load.add_done_callback(self._loaded)

    def _loaded(self, load: Future[Generation | None]) -> None:
        with self._cond:
            if not self._stopping:
                self._cond.notify()
                return
            if load not in self._loading:
                return
            self._loading.remove(load)
        _fail_loaded(load, LoopStopped("the server is shutting down"))

    def prefill(
        self,
        kv: torch.Tensor,
        start: int,
        token_ids: list[int],
        *,
        background: bool = False,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Prefill ``token_ids`` into ``kv`` after its first ``start`` tokens; blocks until done.

        Returns False when ``cancel`` stopped it first (``kv`` is then partly written).
        """
        return self.prefill_async(kv, start, token_ids, background=background, cancel=cancel).result()

    def prefill_async(
        self,
        kv: torch.Tensor,
        start: int,
        token_ids: list[int],
        *,
        background: bool = False,
        cancel: threading.Event | None = None,
        after: Future[bool] | None = None,
    ) -> Future[bool]:
        """``prefill`` without waiting: the future gives what ``prefill`` returns, or its error.
        With ``after`` (an earlier prefill of the same buffer), it starts once that one is done,
        and gives False without running when that one did not prefill every token."""
        if not token_ids:
            return done(True)
        task = PrefillTask(kv, start, list(token_ids), background, cancel, after)
        with self._cond:
            if self._stopping:
                raise LoopStopped("the server is shutting down")
            self._tasks.append(task)
            self._cond.notify()
        return task.future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread, between steps, and return its result.

        For model work outside requests that must run at the model thread's
        speed (the start-up cost profile): see ``app/threads.py``.
        """
        future: Future[T] = Future()
        with self._cond:
            if self._stopping:
                raise LoopStopped("the server is shutting down")
            self._calls.append((lambda: fn(*args), future))
            self._cond.notify()
        return future.result()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def running(self) -> int:
        return len(self._running)

    def interactive_work(self) -> bool:
        """Whether generations or their prompts' prefill are in flight, or were a moment ago (any
        thread may ask)."""
        if self._incoming or self._waiting or self._running:
            return True
        if time.monotonic() - self._interactive_at < INTERACTIVE_NEAR_S:
            return True
        return any(not task.background and not task.done.is_set() for task in list(self._tasks))

    def model_busy(self) -> bool:
        """Whether the model has something to run now or next (any thread may ask): a codec
        operation that starts while it has not, or while the step loop holds its step for loads
        in flight, may take every core (``app/threads.py``)."""
        return not self._holding and self._has_work()

    def _has_work(self) -> bool:
        if self._incoming or self._waiting or self._running or self._tasks or self._calls or self._calling:
            return True
        return any(load.done() for load in list(self._loading))

    # -- the model thread -------------------------------------------------------------------------

    def _run(self) -> None:
        torch.ones(1 << 16).sum()  # torch's per-thread lazy set-up, before the count is set
        self._set_threads()
        while True:
            with self._cond:
                while not (self._stopping or self._has_work()):
                    self._cond.wait()
                if self._stopping:
                    break
                self._take_arrivals()
                self._hold_for_loads()
                if self._stopping:
                    break
                tasks = list(self._tasks)
                self._calling = bool(self._calls)  # before the queue empties: model_busy reads no lock
                calls, self._calls = list(self._calls), deque()
            for fn, future in calls:
                self._set_threads()
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
                    future.set_exception(exc)
            self._calling = False
            try:
                self._drop_cancelled(tasks)
                self._step(tasks)
            except Exception as exc:  # a bug here must fail the work in flight, not hang it
                log.exception("the step loop failed; failing the requests in flight")
                self._fail_all(exc)
        self._abort_all()

    def _take_arrivals(self) -> None:
        """Under the lock: submitted generations, and those whose loads are done, join the queue."""
        self._waiting.extend(self._incoming)
        self._incoming.clear()
        self._take_loaded()

    def _hold_for_loads(self) -> None:
        """Under the lock: while the next step would run fresh prompts only and loads are in
        flight, wait for them, up to the time that step would take beside them (see the module's
        docstring). Ends early when the loads are done or other work arrives."""
        predicted = self._holdable_step_s()
        if predicted <= 0:
            return
        started = time.monotonic()
        deadline = started + min(HOLD_CONTENTION * predicted, MAX_HOLD_S)
        self._holding = True
        try:
            while not self._stopping and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
                self._take_arrivals()
                if self._holdable_step_s() <= 0:
                    break
        finally:
            self._holding = False
            self.stats.holds += 1
            self.stats.held_s += time.monotonic() - started

    def _holdable_step_s(self) -> float:
        """Under the lock: the profile's time for the next step where it may wait for loads in
        flight; 0 where it may not."""
        if self.prefill_seconds is None or self._calls or all(load.done() for load in self._loading):
            return 0.0
        fresh = [*self._running, *self._waiting]
        if not fresh or any(gen.prefill_started is not None for gen in fresh):
            return 0.0  # nothing to run yet, or something decodes or is half prefilled
        if any(not task.background and _ready(task) for task in self._tasks):
            return 0.0  # a load's text chunk: the load waits for the model, not the other way round
        return max(
            self.prefill_seconds(min(len(gen.job.prompt_ids) - gen.position, IDLE_PREFILL_TOKENS), gen.position)
            for gen in fresh
        )

    def _take_loaded(self) -> None:
        """Under the lock: the generations whose loads are done join the queue for a batch slot."""
        for load in [f for f in self._loading if f.done()]:
            self._loading.remove(load)
            generation = load.result()  # the executor resolves it with a result, never an error
            if generation is not None:
                self._waiting.append(generation)

    def _drop_cancelled(self, tasks: list[PrefillTask]) -> None:
        for gen in [g for g in (*self._waiting, *self._running) if g.cancel.is_set()]:
            gen.finish("abort")
        for task in tasks:
            if (task.cancel is not None and task.cancel.is_set()) or _predecessor_failed(task):
                self._end_task(task)
        self._forget_done()

    def _step(self, tasks: list[PrefillTask]) -> None:
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.popleft())
        self.on_step(len(self._running), len(self._waiting))
        work: list[tuple[Generation | PrefillTask, Segment]] = []
        decoding = [g for g in self._running if not g.prefilling]
        for gen in decoding:
            work.append((gen, gen.segment(1)))
        limit = self.max_batched_tokens if decoding else max(self.max_batched_tokens, IDLE_PREFILL_TOKENS)
        budget = max(limit - len(decoding), MIN_PREFILL_TOKENS)
        prefills: list[Generation | PrefillTask] = [g for g in self._running if g.prefilling]
        prefills += sorted((t for t in tasks if not t.background and _ready(t)), key=_arrival)
        budget = self._fill(work, prefills, budget)
        background = sorted((t for t in tasks if t.background and _ready(t)), key=_arrival)
        if not work:
            near = time.monotonic() - self._interactive_at < INTERACTIVE_NEAR_S
            self._fill(work, background, BACKGROUND_NEAR_STEP_TOKENS if near else BACKGROUND_STEP_TOKENS)
        else:
            self._interactive_at = time.monotonic()
            if background and self._interactive_at - self._background_at >= BACKGROUND_AGING_S:
                self._fill(work, background, min(budget, MIN_PREFILL_TOKENS))  # never starved outright
                self._background_at = self._interactive_at
        if not work:
            return
        self._set_threads()
        started = time.perf_counter()
        try:
            results = self.runner.forward_ragged([segment for _, segment in work])
        except Exception as exc:  # every owner of the step hears of it
            log.exception("a model step failed; failing its %d sequences", len(work))
            for owner, _ in work:
                self._fail(owner, exc)
            self._forget_done()
            return
        self._account(work, len(decoding), time.perf_counter() - started)
        alone = len(work) == 1
        sampling: list[tuple[Generation, torch.Tensor]] = []  # who gets a token, and its logits
        for (owner, segment), logits in zip(work, results):
            if isinstance(owner, PrefillTask):
                owner.start_offset += len(segment.token_ids)
                if owner.remaining == 0:
                    self._end_task(owner)
                continue
            try:
                row = owner.advance(segment, logits, alone)
                if row is not None:
                    sampling.append((owner, row))
            except Exception as exc:  # one request's bug must not stop the loop
                log.exception("request failed after a model step")
                owner.fail(exc)
        self._sample(sampling)
        self._forget_done()

    @staticmethod
    def _sample(sampling: list[tuple[Generation, torch.Tensor]]) -> None:
        """Every request's next token, from one batched sampler call."""
        scored: list[tuple[Generation, torch.Tensor, torch.Tensor]] = []
        for gen, logits in sampling:
            try:
                scored.append((gen, logits, gen.scores(logits)))
            except Exception as exc:
                log.exception("request failed computing its sampling scores")
                gen.fail(exc)
        if not scored:
            return
        try:
            tokens = sample_batch(
                torch.stack([scores for _, _, scores in scored]),
                [gen.job.sampling for gen, _, _ in scored],
                [gen.generator for gen, _, _ in scored],
            )
        except Exception as exc:  # the batch's requests hear of it; the loop goes on
            log.exception("sampling failed; failing its %d sequences", len(scored))
            for gen, _, _ in scored:
                gen.fail(exc)
            return
        for (gen, logits, _), token in zip(scored, tokens):
            try:
                gen.accept(token, logits)
            except Exception as exc:
                log.exception("request failed after sampling")
                gen.fail(exc)

    @staticmethod
    def _fill(
        work: list[tuple[Generation | PrefillTask, Segment]],
        owners: list[Generation | PrefillTask],
        budget: int,
    ) -> int:
        """Add prefill segments of ``owners``, in order, within ``budget`` tokens; returns what is left."""
        for owner in owners:
            if budget <= 0:
                break
            segment = owner.segment(budget)
            if segment is None:
                continue
            budget -= len(segment.token_ids)
            work.append((owner, segment))
        return budget

    def _set_threads(self) -> None:
        """Give this step its torch threads. torch keeps the count per thread, but a thread's first
        parallel op resets it to the count last set by any thread (the prepare threads' one), so
        it is checked against torch's own value, not a cached one: a model thread whose first
        forward pass came after a prepare thread started ran every step on one thread (a cold
        3.7K-token prefill took 17-18 s instead of 10-11 s on 2 cores)."""
        if self.torch_threads is None:
            return
        wanted = self.torch_threads()
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def _account(self, work: list, decodes: int, seconds: float) -> None:
        stats = self.stats
        stats.steps += 1
        stats.busy_s += seconds
        stats.decode_tokens += decodes
        stats.prefill_tokens += sum(len(segment.token_ids) for _, segment in work) - decodes

    def _fail(self, owner: Generation | PrefillTask, exc: BaseException) -> None:
        if isinstance(owner, PrefillTask):
            owner.error = exc
            self._end_task(owner)
        else:
            owner.fail(exc)

    def _end_task(self, task: PrefillTask) -> None:
        with self._cond:
            if task in self._tasks:
                self._tasks.remove(task)
        task.finish()

    def _forget_done(self) -> None:
        self._running = [g for g in self._running if not g.done]
        self._waiting = deque(g for g in self._waiting if not g.done)

    def _abort_all(self) -> None:
        self._fail_all(LoopStopped("the server is shutting down"))

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._take_arrivals()  # loads still in progress fail when they end: ``_loaded``
            tasks, self._tasks = list(self._tasks), []
        for gen in (*self._waiting, *self._running):
            gen.fail(exc)
        for task in tasks:
            task.error = exc
            task.finish()
        self._running, self._waiting = [], deque()


def _fail_loaded(load: Future[Generation | None], exc: BaseException) -> None:
    generation = load.result()
    if generation is not None:
        generation.fail(exc)


def _ready(task: PrefillTask) -> bool:
    """Whether a task has tokens to prefill now: not over, and its predecessor done."""
    return not task.done.is_set() and (task.after is None or task.after.done())


def _predecessor_failed(task: PrefillTask) -> bool:
    after = task.after
    return after is not None and after.done() and (after.exception() is not None or not after.result())


def _arrival(task: PrefillTask) -> float:
    return task.arrived
