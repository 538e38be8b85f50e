"""A generation request up to the step loop: KV memory, the stored prefix, then the hand-off.

``RequestExecutor.run`` runs on a prepare thread, never on the model thread:

1. reserve the request's KV memory (``prompt + max_tokens`` tokens, and the
   fetched chunks a load from the store may hold until it is done), waiting
   while the budget is full;
2. find what the store holds of the prompt and load it into the request's KV
   buffer: fetches on the I/O pool, decoding here, and the adaptive plan's text
   chunks as prefill on the step loop (``PrefixLoader``);
3. hand a ``Generation`` to the step loop, which prefills the rest of the
   prompt and generates. A request still loading holds no batch slot.

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

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from engine import ModelRunner
from scheduler.contexts import ContextStore
from scheduler.generation import Finished, Generation, GenerationJob, PrefixReport
from scheduler.kv_memory import KVMemory
from scheduler.loader import PrefixLoader
from scheduler.prefix_cache import MAX_PARTS, CachedRun, Hit, PrefixCache, parts
from scheduler.prefix_load import KVRequest, PrefixLoad
from scheduler.step_loop import StepLoop
from scheduler.stored import StoredPrefix, find_stored_prefix
from scheduler.write_back import WriteBack


@dataclass
class LoopTarget:
    """What the prefix loader writes into: the request's buffer, with text chunks prefilled on the loop."""

    kv: torch.Tensor
    loop: StepLoop
    cancel: threading.Event

    def new_kv(self, tokens: int) -> torch.Tensor:
        assert tokens <= self.kv.shape[3], "the request's buffer is sized for the whole request"
        return self.kv

    def start_prefill(self, kv: torch.Tensor, start: int, token_ids: list[int]) -> Future[bool]:
        return self.loop.prefill_async(kv, start, token_ids, cancel=self.cancel)


@dataclass
class _Buffer:
    """Where a request's KV goes: the read-only parts it shares, then its own buffer."""

    kv: torch.Tensor
    nbytes: int  # the KV memory reserved for ``kv``
    shared: tuple[torch.Tensor, ...] = ()
    attached: CachedRun | None = None  # a cached run taken over, whose buffer ``kv`` is
    reading: Hit | None = None  # a hit shared: pinned until the request finishes
    staging: int = 0  # KV memory reserved for the load's fetched chunks, released after the load

    @property
    def in_place(self) -> bool:
        return self.attached is not None or self.reading is not None


@dataclass
class RequestExecutor:
    runner: ModelRunner
    contexts: ContextStore
    loader: PrefixLoader
    loop: StepLoop
    memory: KVMemory
    write_back: WriteBack | None = None
    cache: PrefixCache | None = None

    def check(self, job: GenerationJob) -> None:
        """Refuse at once a request that could never fit the KV memory budget."""
        self.memory.check(self.kv_bytes(job))

    def kv_bytes(self, job: GenerationJob) -> int:
        return self.runner.kv_bytes(job.capacity)

    def run(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> None:
        handed = False
        try:
            handed = self._run(job, emit, cancel)
        finally:
            if job.prompt_ready is not None and not handed:
                job.prompt_ready.set()  # never reached the loop: the other choices go on alone

    def _run(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> bool:
        """Returns whether the generation was handed to the step loop."""
        t0 = time.perf_counter()
        if job.after is not None:
            while not job.after.wait(0.05):  # the first choice's prompt, then its KV from memory
                if cancel.is_set():
                    emit(Finished("abort", 0))
                    return False
        hit = self._lookup(job)
        buffer = self._acquire(job, hit, cancel)
        if buffer is None:
            emit(Finished("abort", 0))
            return False
        kv, nbytes, attached, reading = buffer.kv, buffer.nbytes, buffer.attached, buffer.reading
        runs: list[CachedRun] = [attached] if attached is not None else []
        handed = False
        try:
            try:
                # the last prompt token is always recomputed: its logits give the first output token
                keys = self.contexts.keys(job.prompt_ids[:-1], job.key_space) if job.kv is not None else []
                target = LoopTarget(kv, self.loop, cancel)
                load = self._load_prefix(job, keys, target, cancel, hit, buffer)
            finally:
                self.memory.release(buffer.staging)
            budget = job.kv.budget_s if job.kv is not None else None
            cached = load.stored_tokens + load.memory_tokens
            report = PrefixReport(
                cached_tokens=cached,
                recomputed_tokens=len(job.prompt_ids) - cached,
                chunks=load.chunks,
                load_ms=_ms(time.perf_counter() - t0),
                prefill_ms=0.0,
                faults=load.faults,
                bandwidth_bps=load.bandwidth_bps,
                budget_ms=None if budget is None else _ms(budget),
                planned_ms=None if load.planned_s is None else _ms(load.planned_s),
                memory_tokens=load.memory_tokens,
            )
            generation = Generation(
                job,
                self.runner,
                kv,
                load.tokens,
                report,
                emit,
                cancel,
                on_prefilled=lambda g: self._prefilled(g, keys, load, runs, nbytes, reading),
                on_finished=lambda g: self._finished(g, runs, nbytes, reading),
                shared=buffer.shared,
            )
            self.loop.submit(generation)
            handed = True
        finally:
            if hit is not None and attached is None and (reading is None or not handed):
                self._unpin(hit)
            if not handed:
                if attached is not None and self.cache is not None:
                    self.memory.release(self.cache.release(attached, None, job.key_space))
                else:
                    self.memory.release(nbytes)
        # after the hand-off: the request does not wait for these
        if load.bad_chunks:
            self.contexts.forget_chunks(keys[0], set(load.bad_chunks))
        if load.stored_tokens:
            self.contexts.touch(keys[0])
        return handed

    def _acquire(self, job: GenerationJob, hit: Hit | None, cancel: threading.Event) -> _Buffer | None:
        """The request's KV buffer. An unused cached buffer with room for the whole request is
        taken over; otherwise a hit from memory alone is shared, and the new buffer holds only the
        tokens after it; otherwise the buffer holds the whole request. None: cancelled while
        waiting for KV memory (the hit is then unpinned)."""
        memory_only = hit is not None and self._memory_suffices(job, hit)
        staging = self._staging_bytes(job, memory_only)
        attached = self._take(job, hit, memory_only)
        if attached is not None:
            shared = tuple(parts(attached.parent, attached.offset)) if attached.parent is not None else ()
            # holding the taken buffer, a blocking wait could deadlock: without the staging
            # memory the load fetches one chunk at a time
            staging = staging if staging and self.memory.try_reserve(staging) else 0
            return _Buffer(attached.kv, attached.nbytes, shared, attached=attached, staging=staging)
        shared = tuple(hit.parts()) if hit is not None and memory_only else ()
        reading = hit if 0 < len(shared) < MAX_PARTS else None
        tokens = job.capacity - (reading.tokens if reading is not None else 0)
        nbytes = self.runner.kv_bytes(tokens)
        staging = max(0, min(staging, self.memory.budget - nbytes))  # never what makes a request too large
        if not self.memory.reserve(nbytes + staging, cancel):
            self._unpin(hit)
            return None
        kv = self.runner.new_kv(tokens)
        return _Buffer(kv, nbytes, shared, reading=reading, staging=staging)

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
        self,
        job: GenerationJob,
        keys: list[str],
        target: LoopTarget,
        cancel: threading.Event,
        hit: Hit | None,
        buffer: _Buffer,
    ) -> PrefixLoad:
        """Memory first, then the store when it holds at least a chunk more than memory.
        When ``buffer`` is in place, the hit's KV is read where it lies (taken over or shared),
        not copied."""
        if job.kv is None:
            return PrefixLoad(kv=None)
        if hit is not None and self._memory_suffices(job, hit):
            return self._from_memory(hit, target.kv, buffer.in_place)
        load = self._load_stored(job, keys, target, cancel, buffer.staging)
        if hit is not None and hit.tokens + self.contexts.chunk_size > load.tokens:
            memory = self._from_memory(hit, target.kv, buffer.in_place)  # over what the store wrote
            memory.faults = load.faults
            return memory
        return load

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
    ) -> PrefixLoad:
        assert job.kv is not None
        stored = StoredPrefix()
        if keys:
            stored = find_stored_prefix(
                self.contexts.store,
                self.contexts.fingerprint,
                self.contexts.chunk_size,
                keys,
                job.prompt_ids[:-1],
                job.kv.levels,
            )
        if not stored.chunks:
            return PrefixLoad(kv=None, faults=stored.faults)
        load = self.loader.load(
            target,
            stored,
            job.prompt_ids[:-1],
            job.kv,
            len(job.prompt_ids),
            job.admitted,
            cancel,
            job.capacity,
            staging,
        )
        used = {c.index for c in load.chunks if c.source == "store"}
        load.distortion = max(
            (job.kv.distortion.get(c.level, 0.0) for c in load.chunks if c.source == "store" and c.level),
            default=0.0,
        )
        load.expires = min(
            (c.expires for c in stored.chunks if c.index in used and c.expires is not None), default=None
        )
        load.store_key = keys[0] if used else None
        return load

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
        self, generation: Generation, runs: list[CachedRun], nbytes: int, reading: Hit | None
    ) -> None:
        """The generation's memory goes to the prefix cache with every token it computed, or back;
        then it lets go of the hit it read."""
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
