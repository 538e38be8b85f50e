"""A generation request up to the step loop: its states, KV memory, the stored prefix, the hand-off.

A request moves through ``RequestState``: **waiting** (for its KV memory, or
for its sibling's prompt when it is one of ``n`` choices), **loading** (its
prefix from memory or the store), then **running** on the step loop (which
queues it for a batch slot), and **finished**. No thread waits on its behalf:

1. ``start`` (on the caller's thread; it never blocks) hands the request to
   a prepare thread, which asks the prefix cache for KV already in memory and
   reserves the request's KV memory (``prompt + max_tokens`` tokens, less a
   hit it shares, and the fetched chunks a load from the store may hold until
   it is done). What does not fit at once is waited for as a future
   (``KVMemory.reserve_async``), with the hit given back meanwhile (``_admit``).
   A choice that follows its sibling's prompt (``job.after``) does this when
   the sibling's prompt is in memory;
2. once the memory is granted, a prepare thread loads the prefix into the
   request's buffer: fetches on the I/O pool, decoding there, and the adaptive
   plan's text chunks as prefill on the step loop (``PrefixLoader.start``);
   the step loop holds the load as a future from then on and checks it
   every step;
3. when the text chunks are in too, the load's future gives the step loop a
   ``Generation``, which prefills the rest of the prompt and generates. A
   request still loading holds no batch slot.

Before the store, the prefix cache (``scheduler/prefix_cache.py``) is asked
for KV already in memory; the store is read only when it could add at least
a chunk more. A hit from memory alone is attached, never copied: the request
takes the cached buffer over when nobody uses it and it has room, and
otherwise shares it (its own buffer, and its reservation, hold only the
tokens after the hit). A generation publishes its buffer there when its
prompt is done, and on finishing hands its memory to the cache (which
releases it when it holds nothing new); a failed one releases it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import ModelRunner
from scheduler.contexts import ContextStore
from scheduler.flag import Flag, when_set
from scheduler.futures import done, once, then
from scheduler.generation import Finished, Generation, GenerationJob, PrefixReport
from scheduler.kv_memory import KVMemory
from scheduler.loader import PrefixLoader
from scheduler.prefix_cache import MAX_PARTS, CachedRun, Hit, PrefixCache, parts
from scheduler.prefix_load import KVRequest, PrefixLoad
from scheduler.step_loop import LoopStopped, StepLoop
from scheduler.stored import StoredPrefix, find_stored_prefix
from scheduler.write_back import WriteBack

log = logging.getLogger(__name__)


class RequestState(enum.Enum):
    WAITING = "waiting"  # for its KV memory, or for its sibling's prompt
    LOADING = "loading"  # its prefix, from memory or the store
    RUNNING = "running"  # on the step loop: queued for a batch slot, prefilling or generating
    FINISHED = "finished"


@dataclass
class LoopTarget:
    """What the prefix loader writes into: the request's buffer, with text chunks prefilled on the loop."""

    kv: torch.Tensor
    loop: StepLoop
    cancel: threading.Event

    def new_kv(self, tokens: int) -> torch.Tensor:
        assert tokens <= self.kv.shape[3], "the request's buffer is sized for the whole request"
        return self.kv

    def start_prefill(
        self, kv: torch.Tensor, start: int, token_ids: list[int], after: Future[bool] | None = None
    ) -> Future[bool]:
        return self.loop.prefill_async(kv, start, token_ids, cancel=self.cancel, after=after)


@dataclass(eq=False)
class _Buffer:
    """Where a request's KV goes: the read-only parts it shares, then its own buffer."""

    kv: torch.Tensor | None  # None until its memory is granted
    tokens: int  # what ``kv`` holds
    nbytes: int  # the KV memory reserved for ``kv``
    shared: tuple[torch.Tensor, ...] = ()
    attached: CachedRun | None = None  # a cached run taken over, whose buffer ``kv`` is
    reading: Hit | None = None  # a hit shared: pinned until the request finishes
    staging: int = 0  # KV memory reserved for the load's fetched chunks, released after the load
    reserved: bool = False  # ``nbytes + staging`` granted (an attached buffer's are the cache's)

    @property
    def in_place(self) -> bool:
        return self.attached is not None or self.reading is not None


@dataclass(eq=False)
class _Request:
    """What a request holds until a ``Generation`` owns it."""

    job: GenerationJob
    emit: Callable[[Any], None]
    cancel: threading.Event
    arrived: float = field(default_factory=time.perf_counter)
    state: RequestState | None = None
    hit: Hit | None = None
    # KV memory granted after a wait, not yet given to a buffer: the next ``_admit`` keeps what
    # its plan needs and releases the rest
    credit: int = 0
    waited: bool = False  # it has waited for memory once: a second wait is for the whole request
    buffer: _Buffer | None = None
    keys: list[str] = field(default_factory=list)
    handed: bool = False  # a generation owns its memory from now on


@dataclass
class RequestExecutor:
    runner: ModelRunner
    contexts: ContextStore
    loader: PrefixLoader
    loop: StepLoop
    memory: KVMemory
    pool: ThreadPoolExecutor  # prepare threads: lookups, store probes and decoding, never waiting
    write_back: WriteBack | None = None
    cache: PrefixCache | None = None
    _states: dict[RequestState, int] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def check(self, job: GenerationJob) -> None:
        """Refuse at once a request that could never fit the KV memory budget."""
        self.memory.check(self.kv_bytes(job))

    def kv_bytes(self, job: GenerationJob) -> int:
        return self.runner.kv_bytes(job.capacity)

    def count(self, state: RequestState) -> int:
        """Requests in ``state`` now (not ``FINISHED``)."""
        return self._states.get(state, 0)

    def start(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> None:
        """Take a request in; never blocks. Its events, or its error, come through ``emit`` from
        the thread that has them; the request ends with a ``Finished`` or an exception."""
        request = _Request(job, emit, cancel)
        self._enter(request, RequestState.WAITING)
        after = job.after
        if after is None or after.is_set():
            self._submit(request, self._admit)
            return
        if not isinstance(after, Flag):
            raise TypeError("a choice that follows its sibling waits on a scheduler.flag.Flag")
        admit = once(lambda: self._submit(request, self._admit))  # the sibling's prompt, or a cancel
        after.add_callback(admit)
        when_set(cancel, admit)

    # -- the stages: each runs on a prepare thread, and ends by asking for the next ----------------

    def _admit(self, request: _Request) -> None:
        """Look the prompt up in memory and ask for the request's KV memory. An unused cached
        buffer with room for the whole request is taken over; otherwise a hit from memory alone is
        shared, and the new buffer holds only the tokens after it; otherwise the buffer holds the
        whole request.

        A request whose memory is not there at once waits for it holding no hit. A hit is pinned,
        and the cache cannot free a pinned run: had waiters kept their hits, cached KV that they
        pinned could fill the budget with nothing left to free it, and every one of them would
        wait for ever (32 clients on 8 stored contexts did). So it unpins and waits for what its
        plan needs. Once that is granted it is admitted again: it looks the prompt up anew and
        keeps what the new plan needs. If the hit was evicted meanwhile and the plan needs more,
        it waits once more, for its whole request's memory, which any plan fits."""
        if request.cancel.is_set():
            self._abort(request)
            return
        job = request.job
        hit = request.hit = self._lookup(job)
        memory_only = hit is not None and self._memory_suffices(job, hit)
        staging = self._staging_bytes(job, memory_only)
        attached = self._take(job, hit, memory_only)
        if attached is not None:
            shared = tuple(parts(attached.parent, attached.offset)) if attached.parent is not None else ()
            # nothing waits holding the taken buffer: without the staging memory the load fetches
            # one chunk at a time
            staging = staging if self._reserve_now(request, staging) else 0
            request.buffer = _Buffer(
                attached.kv, attached.kv.shape[3], attached.nbytes, shared, attached=attached, staging=staging
            )
            self._load(request)
            return
        shared = tuple(hit.parts()) if hit is not None and memory_only else ()
        reading = hit if 0 < len(shared) < MAX_PARTS else None
        tokens = job.capacity - (reading.tokens if reading is not None else 0)
        nbytes = self.runner.kv_bytes(tokens)
        staging = max(0, min(staging, self.memory.budget - nbytes))  # never what makes a request too large
        buffer = request.buffer = _Buffer(None, tokens, nbytes, shared, reading=reading)
        if self._reserve_now(request, nbytes + staging):
            buffer.reserved, buffer.staging = True, staging
            self._granted(request)
            return
        request.buffer = None
        self._unpin(hit)
        request.hit = None
        # first for what this plan needs; if the hit is gone by then, for the whole request
        wanted = self._whole_bytes(job) if request.waited else nbytes + staging
        request.waited = True

        def granted(answer: Future[bool]) -> None:  # where the memory came free, or the cancel
            if not answer.result():  # cancelled while it waited: nothing is held
                self._submit(request, self._abort)
                return
            request.credit = wanted
            self._submit(request, self._admit)

        self.memory.reserve_async(wanted, request.cancel).add_done_callback(granted)

    def _reserve_now(self, request: _Request, nbytes: int) -> bool:
        """Reserve ``nbytes`` without waiting: out of the request's credit when it covers them (the
        rest is released; a credit too small is released whole), else when they fit now and nobody
        waits first."""
        if request.credit:
            credit, request.credit = request.credit, 0
            if nbytes <= credit:
                self.memory.release(credit - nbytes)
                return True
            self.memory.release(credit)
        return nbytes == 0 or self.memory.try_reserve(nbytes)

    def _whole_bytes(self, job: GenerationJob) -> int:
        """The most KV memory any plan of ``job`` needs: a buffer for all of it, and a load's staging."""
        nbytes = self.kv_bytes(job)
        return nbytes + max(0, min(self._staging_bytes(job, False), self.memory.budget - nbytes))

    def _granted(self, request: _Request) -> None:
        buffer = request.buffer
        assert buffer is not None
        if not buffer.reserved or request.cancel.is_set():
            self._abort(request)
            return
        buffer.kv = self.runner.new_kv(buffer.tokens)
        self._load(request)

    def _load(self, request: _Request) -> None:
        """Load the prefix: the step loop holds the load as a future from here on."""
        job, buffer = request.job, request.buffer
        assert buffer is not None and buffer.kv is not None
        self._enter(request, RequestState.LOADING)
        # the last prompt token is always recomputed: its logits give the first output token
        keys = request.keys = (
            self.contexts.keys(job.prompt_ids[:-1], job.key_space) if job.kv is not None else []
        )
        pending: Future[Generation | None] = Future()
        self.loop.submit_loading(pending)
        try:
            loading = self._load_prefix(job, keys, LoopTarget(buffer.kv, self.loop, request.cancel), request)
        except BaseException:
            pending.set_result(None)
            raise
        loading.add_done_callback(lambda loaded: self._loaded(request, loaded, pending))

    def _loaded(
        self, request: _Request, loading: Future[PrefixLoad], pending: Future[Generation | None]
    ) -> None:
        """The prefix is in (on the thread that finished it: the model thread after text chunks):
        the generation goes to the step loop, or the request ends with the load's error."""
        generation = None
        try:
            buffer = request.buffer
            assert buffer is not None
            self.memory.release(buffer.staging)
            buffer.staging = 0
            load = loading.result()
            generation = self._generation(request, load)
        except BaseException as exc:  # noqa: BLE001 - the client hears of it
            self._fail(request, exc)
        finally:
            pending.set_result(generation)
        if generation is not None:
            self._submit_quietly(self._after_load, request.keys, load)

    def _generation(self, request: _Request, load: PrefixLoad) -> Generation:
        job, buffer = request.job, request.buffer
        assert buffer is not None and buffer.kv is not None
        budget = job.kv.budget_s if job.kv is not None else None
        cached = load.stored_tokens + load.memory_tokens
        report = PrefixReport(
            cached_tokens=cached,
            recomputed_tokens=len(job.prompt_ids) - cached,
            chunks=load.chunks,
            load_ms=_ms(time.perf_counter() - request.arrived),
            prefill_ms=0.0,
            faults=load.faults,
            bandwidth_bps=load.bandwidth_bps,
            budget_ms=None if budget is None else _ms(budget),
            planned_ms=None if load.planned_s is None else _ms(load.planned_s),
            memory_tokens=load.memory_tokens,
        )
        runs: list[CachedRun] = [buffer.attached] if buffer.attached is not None else []
        keys, nbytes, reading = request.keys, buffer.nbytes, buffer.reading
        generation = Generation(
            job,
            self.runner,
            buffer.kv,
            load.tokens,
            report,
            request.emit,
            request.cancel,
            on_prefilled=lambda g: self._prefilled(g, keys, load, runs, nbytes, reading),
            on_finished=lambda g: self._finished(request, g, runs, nbytes, reading),
            shared=buffer.shared,
        )
        request.handed = True
        if reading is None and buffer.attached is None and request.hit is not None:
            self._unpin(request.hit)  # a hit only copied (or the store's chunks came first)
        request.hit = None
        self._enter(request, RequestState.RUNNING)
        return generation

    def _after_load(self, keys: list[str], load: PrefixLoad) -> None:
        """What the request does not wait for: the store's index hears of bad chunks and of use."""
        if load.bad_chunks:
            self.contexts.forget_chunks(keys[0], set(load.bad_chunks))
        if load.stored_tokens:
            self.contexts.touch(keys[0])

    # -- ending before the step loop -------------------------------------------------------------

    def _abort(self, request: _Request) -> None:
        self._drop(request)
        request.emit(Finished("abort", 0))

    def _fail(self, request: _Request, exc: BaseException) -> None:
        self._drop(request)
        request.emit(exc)

    def _drop(self, request: _Request) -> None:
        """Give back what a request holds that no generation owns (at most once)."""
        if request.handed or request.state is RequestState.FINISHED:
            return
        buffer, request.buffer = request.buffer, None
        self.memory.release(request.credit)
        request.credit = 0
        if buffer is not None:
            self.memory.release(buffer.staging)
            if buffer.attached is not None and self.cache is not None:
                self.memory.release(self.cache.release(buffer.attached, None, request.job.key_space))
            elif buffer.reserved:
                self.memory.release(buffer.nbytes)
        if buffer is None or buffer.attached is None:
            self._unpin(request.hit)
        request.hit = None
        self._enter(request, RequestState.FINISHED)
        if request.job.prompt_ready is not None:
            request.job.prompt_ready.set()  # never reached the loop: the other choices go on alone

    # -- threads and states ----------------------------------------------------------------------

    def _submit(self, request: _Request, stage: Callable[[_Request], None]) -> None:
        """Run ``stage`` on a prepare thread; its error ends the request."""

        def run() -> None:
            try:
                stage(request)
            except BaseException as exc:
                if request.handed:
                    log.exception("a request's stage failed after its hand-off")
                else:
                    self._fail(request, exc)

        try:
            self.pool.submit(run)
        except RuntimeError:  # the pool is shut down
            self._fail(request, LoopStopped("the server is shutting down"))

    def _submit_quietly(self, fn: Callable[..., None], *args: Any) -> None:
        """Best-effort work on a prepare thread, after the request no longer waits for it."""
        try:
            self.pool.submit(fn, *args)
        except RuntimeError:
            pass

    def _enter(self, request: _Request, state: RequestState) -> None:
        with self._lock:
            if request.state is not None:
                self._states[request.state] -= 1
            if state is not RequestState.FINISHED:
                self._states[state] = self._states.get(state, 0) + 1
            request.state = state

    def _staging_bytes(self, job: GenerationJob, memory_only: bool) -> int:
        """KV memory for the chunks a load from the store holds at once; 0 when none can run."""
        chunk = self.contexts.chunk_size
        if job.kv is None or memory_only or len(job.prompt_ids) - 1 < chunk:
            return 0
        return self.loader.staging_bytes(chunk)

    def _memory_suffices(self, job: GenerationJob, hit: Hit) -> bool:
        """Whether the store could not add a chunk to what memory holds of the prompt."""
        return hit.tokens + self.contexts.chunk_size > len(job.prompt_ids) - 1

    def _take(self, job: GenerationJob, hit: Hit | None, memory_only: bool) -> CachedRun | None:
        """The hit's buffer, for the request to write on, when nobody else uses it. A buffer that
        continues a parent's is taken only when memory alone serves the prompt (the store's
        chunks are loaded from the first token, into a buffer of the request's own)."""
        if hit is None or self.cache is None or (hit.run.parent is not None and not memory_only):
            return None
        return self.cache.take(hit, job.capacity)

    def _unpin(self, hit: Hit | None) -> None:
        if hit is not None and self.cache is not None:
            self.memory.release(self.cache.unpin(hit))

    def _lookup(self, job: GenerationJob) -> Hit | None:
        """KV in memory for ``job``: for ``auto``, any within its levels' quality; for a level the
        client named, only exact KV, and only when that level is lossless (a lossy level named is
        a request for those bytes: to compare levels, say)."""
        if self.cache is None or job.kv is None:
            return None
        if job.kv.fixed and not job.kv.levels[0].lossless:
            return None
        return self.cache.lookup(job.prompt_ids[:-1], job.key_space, _worst_distortion(job.kv))

    def _load_prefix(
        self, job: GenerationJob, keys: list[str], target: LoopTarget, request: _Request
    ) -> Future[PrefixLoad]:
        """Memory first, then the store when it holds at least a chunk more than memory.
        When the buffer is in place, the hit's KV is read where it lies (taken over or shared),
        not copied. Decodes here; the future is done when the text chunks are in too."""
        hit, buffer = request.hit, request.buffer
        assert buffer is not None
        if job.kv is None:
            return done(PrefixLoad(kv=None))
        if hit is not None and self._memory_suffices(job, hit):
            return done(self._from_memory(hit, target.kv, buffer.in_place))
        loading = self._load_stored(job, keys, target, request.cancel, buffer.staging)
        if hit is None:
            return loading

        def over_memory(load: PrefixLoad) -> PrefixLoad:
            if hit.tokens + self.contexts.chunk_size <= load.tokens:
                return load
            memory = self._from_memory(hit, target.kv, buffer.in_place)  # over what the store wrote
            memory.faults = load.faults
            return memory

        return then(loading, over_memory)

    def _from_memory(self, hit: Hit, kv: torch.Tensor, in_place: bool) -> PrefixLoad:
        if not in_place:  # a chain too long to share, or the store's chunks came first
            if self.cache is not None:
                self.cache.count_copy(hit.tokens)
            at = 0
            for part in hit.parts():
                kv[:, :, :, at : at + part.shape[3]].copy_(part)
                at += part.shape[3]
        return PrefixLoad(
            kv=kv,
            tokens=hit.tokens,
            memory_tokens=hit.tokens,
            exact=hit.run.distortion == 0,
            distortion=hit.run.distortion,
            expires=hit.run.expires,
            store_key=hit.run.store_key,
        )

    def _load_stored(
        self, job: GenerationJob, keys: list[str], target: LoopTarget, cancel: threading.Event, staging: int
    ) -> Future[PrefixLoad]:
        assert job.kv is not None
        kv_request = job.kv
        stored = StoredPrefix()
        if keys:
            stored = find_stored_prefix(
                self.contexts.store,
                self.contexts.fingerprint,
                self.contexts.chunk_size,
                keys,
                job.prompt_ids[:-1],
                kv_request.levels,
            )
        if not stored.chunks:
            return done(PrefixLoad(kv=None, faults=stored.faults))
        loading = self.loader.start(
            target,
            stored,
            job.prompt_ids[:-1],
            kv_request,
            len(job.prompt_ids),
            job.admitted,
            cancel,
            job.capacity,
            staging,
        )

        def described(load: PrefixLoad) -> PrefixLoad:
            used = {c.index for c in load.chunks if c.source == "store"}
            load.distortion = max(
                (
                    kv_request.distortion.get(c.level, 0.0)
                    for c in load.chunks
                    if c.source == "store" and c.level
                ),
                default=0.0,
            )
            load.expires = min(
                (c.expires for c in stored.chunks if c.index in used and c.expires is not None), default=None
            )
            load.store_key = keys[0] if used else None
            return load

        return then(loading, described)

    def _prefilled(
        self,
        generation: Generation,
        keys: list[str],
        load: PrefixLoad,
        runs: list[CachedRun],
        nbytes: int,
        reading: Hit | None,
    ) -> None:
        """On the model thread, when the prompt is done: publish its KV, learn its costs, start
        write-back."""
        job = generation.job
        if self.cache is not None:
            distortion = load.distortion if load.tokens else 0.0
            if runs:  # an attached buffer: its blocks grow to the whole prompt
                self.cache.extend(runs[0], job.prompt_ids, job.key_space)
            else:
                run = self.cache.publish(
                    generation.kv,
                    job.prompt_ids,
                    nbytes,
                    job.key_space,
                    distortion,
                    load.store_key,
                    load.expires,
                    parent=reading,
                )
                runs.append(run)
            if job.prompt_ready is not None:
                job.prompt_ready.set()
        if generation.prefill_alone:  # a step shared with others says little about prefill speed
            seconds = generation.report.prefill_ms / 1000
            self.loader.profile.observe_prefill(len(job.prompt_ids) - load.tokens, load.tokens, seconds)
        self.loader.observe_outcome(load.planned_s, time.perf_counter() - job.admitted)
        if self.write_back is None or not keys:
            return
        first = load.tokens // self.contexts.chunk_size
        if len(keys) > first:
            self.write_back.submit(keys, generation.parts, first=first, exact=load.exact)

    def _finished(
        self,
        request: _Request,
        generation: Generation,
        runs: list[CachedRun],
        nbytes: int,
        reading: Hit | None,
    ) -> None:
        """The generation's memory goes to the prefix cache with every token it computed, or back;
        then it lets go of the hit it read."""
        self._enter(request, RequestState.FINISHED)
        if generation.job.prompt_ready is not None:
            generation.job.prompt_ready.set()
        if self.cache is None or not runs:
            self.memory.release(nbytes)
        else:
            failed = generation.failed
            ids = None if failed else generation.computed_ids
            self.memory.release(self.cache.release(runs[0], ids, generation.job.key_space))
        self._unpin(reading)


def _worst_distortion(request: KVRequest) -> float:
    """The most quality loss a request accepts: its worst candidate level's."""
    return max((request.distortion.get(level.name, 0.0) for level in request.levels), default=0.0)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
