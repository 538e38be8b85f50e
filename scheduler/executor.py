"""A generation request up to the step loop: KV memory, the stored prefix, then the hand-off.

``RequestExecutor.run`` runs on a prepare thread, never on the model thread:

1. reserve the request's KV memory (``prompt + max_tokens`` tokens), waiting
   while the budget is full;
2. find what the store holds of the prompt and load it into the request's KV
   buffer: fetches on the I/O pool, decoding here, and the adaptive plan's text
   chunks as prefill on the step loop (``PrefixLoader``);
3. hand a ``Generation`` to the step loop, which prefills the rest of the
   prompt and generates. A request still loading holds no batch slot.

The memory is released when the generation finishes, fails or is cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine import ModelRunner
from scheduler.contexts import ContextStore
from scheduler.generation import Finished, Generation, GenerationJob, PrefixReport
from scheduler.kv_memory import KVMemory
from scheduler.loader import PrefixLoader
from scheduler.prefix_load import PrefixLoad
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

    def prefill_into(self, kv: torch.Tensor, start: int, token_ids: list[int]) -> None:
        self.loop.prefill(kv, start, token_ids, cancel=self.cancel)


@dataclass
class RequestExecutor:
    runner: ModelRunner
    contexts: ContextStore
    loader: PrefixLoader
    loop: StepLoop
    memory: KVMemory
    write_back: WriteBack | None = None

    def check(self, job: GenerationJob) -> None:
        """Refuse at once a request that could never fit the KV memory budget."""
        self.memory.check(self.kv_bytes(job))

    def kv_bytes(self, job: GenerationJob) -> int:
        return job.capacity * self.runner.kv_bytes_per_token

    def run(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> None:
        nbytes = self.kv_bytes(job)
        if not self.memory.reserve(nbytes, cancel):
            emit(Finished("abort", 0))
            return
        handed = False
        try:
            t0 = time.perf_counter()
            kv = self.runner.new_kv(job.capacity)
            # the last prompt token is always recomputed: its logits give the first output token
            keys = self.contexts.keys(job.prompt_ids[:-1], job.key_space) if job.kv is not None else []
            load = self._load_prefix(job, keys, LoopTarget(kv, self.loop, cancel), cancel)
            budget = job.kv.budget_s if job.kv is not None else None
            report = PrefixReport(
                cached_tokens=load.stored_tokens,
                recomputed_tokens=len(job.prompt_ids) - load.stored_tokens,
                chunks=load.chunks,
                load_ms=_ms(time.perf_counter() - t0),
                prefill_ms=0.0,
                faults=load.faults,
                bandwidth_bps=load.bandwidth_bps,
                budget_ms=None if budget is None else _ms(budget),
                planned_ms=None if load.planned_s is None else _ms(load.planned_s),
            )
            generation = Generation(
                job,
                self.runner,
                kv,
                load.tokens,
                report,
                emit,
                cancel,
                on_prefilled=lambda g: self._prefilled(g, keys, load),
                on_finished=lambda g: self.memory.release(nbytes),
            )
            self.loop.submit(generation)
            handed = True
        finally:
            if not handed:
                self.memory.release(nbytes)
        if load.stored_tokens:
            self.contexts.touch(keys[0])  # after the hand-off: the request does not wait for it

    def _load_prefix(
        self, job: GenerationJob, keys: list[str], target: LoopTarget, cancel: threading.Event
    ) -> PrefixLoad:
        if job.kv is None:
            return PrefixLoad(kv=None)
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
        return self.loader.load(
            target,
            stored,
            job.prompt_ids[:-1],
            job.kv,
            len(job.prompt_ids),
            job.admitted,
            cancel,
            job.capacity,
        )

    def _prefilled(self, generation: Generation, keys: list[str], load: PrefixLoad) -> None:
        """On the model thread, when the prompt is done: learn its costs, start write-back."""
        job = generation.job
        if generation.prefill_alone:  # a step shared with others says little about prefill speed
            seconds = generation.report.prefill_ms / 1000
            self.loader.profile.observe_prefill(len(job.prompt_ids) - load.tokens, load.tokens, seconds)
        self.loader.observe_outcome(load.planned_s, time.perf_counter() - job.admitted)
        if self.write_back is None or not keys:
            return
        first = load.tokens // self.contexts.chunk_size
        if len(keys) > first:
            self.write_back.submit(keys, generation.kv, first=first, exact=load.exact)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
