"""One generation request on the model thread: stored prefix, prefill, decode.

Runs synchronously on the worker thread and reports through ``emit``:
``PromptDone`` once the prompt is processed (the first token follows), then
``TokenEvent`` per generated token, then ``Finished``. Events are engine-level
objects; the HTTP layer turns them into protocol messages.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import ModelRunner
from engine.detokenize import IncrementalText
from engine.sampling import SamplingParams
from scheduler.contexts import ContextStore
from scheduler.loader import ChunkReport, KVRequest, PrefixLoad, PrefixLoader
from scheduler.stored import StoredPrefix, find_stored_prefix
from scheduler.write_back import WriteBack


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    kv: KVRequest | None  # None: do not use stored KV
    prompt_logprobs: int | None = None  # echo: logprobs of the prompt tokens, with this many top entries
    logprobs: int | None = None  # logprobs of generated tokens, with this many top entries
    # when the request arrived (time.perf_counter): a kv_slo_ms budget counts from here, so
    # tokenization and waiting for the model thread count against it
    admitted: float = field(default_factory=time.perf_counter)


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None
    top: dict[str, float] | None


@dataclass
class PrefixReport:
    """Where the prompt's KV came from, and what it cost."""

    cached_tokens: int  # from the store
    recomputed_tokens: int  # prefilled: text chunks and everything after the prefix
    chunks: list[ChunkReport]
    load_ms: float  # lookup, fetch, decode and text chunks
    prefill_ms: float  # the prefill after the prefix
    faults: list[str]
    bandwidth_bps: float | None = None  # the link estimate, bytes per second
    budget_ms: float | None = None
    planned_ms: float | None = None  # what the first plan predicted for the prompt
    prompt_ms: float = 0.0  # arrival to first-token logits: what the budget is held to

    @property
    def slo_met(self) -> bool | None:
        return None if self.budget_ms is None else self.prompt_ms <= self.budget_ms


@dataclass
class PromptDone:
    kv_info: PrefixReport
    prompt_logprobs: list[TokenLogprob] | None


@dataclass
class TokenEvent:
    text: str  # text released by this token (may be empty while held back)
    token_id: int
    logprob: TokenLogprob | None


@dataclass
class Finished:
    reason: str  # "stop" or "length"
    completion_tokens: int
    text_tail: str = ""  # text held back until the end


@dataclass
class RequestExecutor:
    runner: ModelRunner
    contexts: ContextStore
    loader: PrefixLoader
    write_back: WriteBack | None = None

    def run(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> None:
        tokenizer = self.runner.tokenizer
        t0 = time.perf_counter()
        # the last prompt token is always recomputed: its logits give the first output token
        keys = self.contexts.keys(job.prompt_ids[:-1]) if job.kv is not None else []
        load = self._load_prefix(job, keys, cancel)
        t1 = time.perf_counter()
        cached = load.tokens
        kv = load.kv if load.kv is not None else self.runner.new_kv(len(job.prompt_ids) + job.max_tokens)
        state = self.runner.prefill(
            job.prompt_ids[cached:],
            kv,
            prefix_tokens=cached,
            want_prompt_logits=job.prompt_logprobs is not None,
        )
        t2 = time.perf_counter()
        load.kv = kv = None  # the cache holds the buffer now
        self.loader.profile.observe_prefill(len(job.prompt_ids) - cached, cached, t2 - t1)
        self.loader.observe_outcome(load.planned_s, t2 - job.admitted)
        self._write_back(keys, load, state.cache)
        prompt_lp = None
        if job.prompt_logprobs is not None:
            prompt_lp = self._prompt_logprobs(job, cached, state.prompt_logits)
        budget = job.kv.budget_s if job.kv is not None else None
        info = PrefixReport(
            cached_tokens=load.stored_tokens,
            recomputed_tokens=len(job.prompt_ids) - load.stored_tokens,
            chunks=load.chunks,
            load_ms=_ms(t1 - t0),
            prefill_ms=_ms(t2 - t1),
            faults=load.faults,
            bandwidth_bps=load.bandwidth_bps,
            budget_ms=None if budget is None else _ms(budget),
            planned_ms=None if load.planned_s is None else _ms(load.planned_s),
            prompt_ms=_ms(t2 - job.admitted),
        )
        emit(PromptDone(info, prompt_lp))

        text = IncrementalText(tokenizer, job.stops)
        produced = 0
        reason = "length"
        generator = self.runner.decode(state, job.sampling, job.max_tokens)
        try:
            for token, logits in generator:
                produced += 1
                delta = text.push(token)
                lp = self._token_logprob(token, logits, job.logprobs) if job.logprobs is not None else None
                emit(TokenEvent(delta, token, lp))
                if text.stopped:
                    reason = "stop"
                    break
                if cancel.is_set():
                    reason = "abort"
                    break
            else:
                if produced < job.max_tokens:
                    reason = "stop"  # end of sequence
        finally:
            generator.close()
        emit(Finished(reason, produced, text.finish()))

    def _load_prefix(self, job: GenerationJob, keys: list[str], cancel: threading.Event) -> PrefixLoad:
        usable = job.prompt_ids[:-1]
        if job.kv is None:
            return PrefixLoad(kv=None)
        stored = StoredPrefix()
        if keys:
            stored = find_stored_prefix(
                self.contexts.store,
                self.contexts.fingerprint,
                self.contexts.chunk_size,
                keys,
                usable,
                job.kv.levels,
            )
        if not stored.chunks:
            return PrefixLoad(kv=None, faults=stored.faults)
        capacity = len(job.prompt_ids) + job.max_tokens
        return self.loader.load(
            self.runner, stored, usable, job.kv, len(job.prompt_ids), job.admitted, cancel, capacity
        )

    def _write_back(self, keys: list[str], load: PrefixLoad, cache: Any) -> None:
        """Store the full chunks after the loaded prefix (a miss), if write-back is on."""
        if self.write_back is None or not keys:
            return
        first = load.tokens // self.contexts.chunk_size
        if len(keys) > first:
            self.write_back.submit(keys, cache, first=first, exact=load.exact)

    def _token_logprob(self, token: int, logits: torch.Tensor, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits, dim=-1)
        return TokenLogprob(
            token=self._piece(token),
            logprob=float(logprobs[token]),
            top=self._top(logprobs, top),
        )

    def _prompt_logprobs(
        self, job: GenerationJob, cached: int, logits: torch.Tensor | None
    ) -> list[TokenLogprob]:
        """Logprobs of prompt tokens; None where no logits exist (the first token, cached tokens)."""
        assert logits is not None and job.prompt_logprobs is not None
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for pos, token in enumerate(job.prompt_ids):
            row = pos - 1 - cached  # logits row that predicted this token
            if row < 0:
                out.append(TokenLogprob(self._piece(token), None, None))
            else:
                value = float(logprobs[row, token])
                out.append(
                    TokenLogprob(
                        self._piece(token),
                        value if math.isfinite(value) else -9999.0,
                        self._top(logprobs[row], job.prompt_logprobs),
                    )
                )
        return out

    def _top(self, logprobs: torch.Tensor, k: int) -> dict[str, float] | None:
        if k <= 0:
            return None
        values, ids = torch.topk(logprobs, k)
        return {self._piece(int(i)): float(v) for v, i in zip(values, ids)}

    def _piece(self, token: int) -> str:
        return self.runner.tokenizer.decode([token])


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
