"""One generation request on the model thread: stored prefix, prefill, decode.

Runs synchronously on the worker thread and reports through ``emit``:
``PromptDone`` once the prompt is processed (the first token follows), then
``TokenEvent`` per generated token, then ``Finished``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from app.protocol import KVCacheInfo, KVChunkInfo
from codec import Level
from engine import ModelRunner
from engine.detokenize import IncrementalText
from engine.sampling import SamplingParams
from scheduler.contexts import ContextStore
from scheduler.loader import PrefixLoad, PrefixLoader
from scheduler.write_back import WriteBack


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: list[str]
    levels: list[Level]  # empty: do not use stored KV
    prompt_logprobs: int | None = None  # echo: logprobs of the prompt tokens, with this many top entries
    logprobs: int | None = None  # logprobs of generated tokens, with this many top entries


@dataclass
class TokenLogprob:
    token: str
    logprob: float | None
    top: dict[str, float] | None


@dataclass
class PromptDone:
    kv_info: KVCacheInfo
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
class Pipeline:
    runner: ModelRunner
    contexts: ContextStore
    loader: PrefixLoader
    write_back: WriteBack | None = None

    def run(self, job: GenerationJob, emit: Callable[[Any], None], cancel: threading.Event) -> None:
        tokenizer = self.runner.tokenizer
        t0 = time.perf_counter()
        # the last prompt token is always recomputed: its logits give the first output token
        keys = self.contexts.keys(job.prompt_ids[:-1]) if job.levels else []
        load = self.loader.load(keys, job.levels) if keys else PrefixLoad(kv=None)
        t1 = time.perf_counter()
        cached = load.tokens
        state = self.runner.prefill(
            job.prompt_ids[cached:], load.kv, want_prompt_logits=job.prompt_logprobs is not None
        )
        t2 = time.perf_counter()
        load.kv = None  # the cache made its own copy: free the decoded tensors before decoding
        if self.write_back is not None and len(keys) > len(load.chunks):
            self.write_back.submit(keys, state.cache, first=len(load.chunks))
        prompt_lp = None
        if job.prompt_logprobs is not None:
            prompt_lp = self._prompt_logprobs(job, cached, state.prompt_logits)
        info = KVCacheInfo(
            cached_tokens=cached,
            recomputed_tokens=len(job.prompt_ids) - cached,
            chunks=[
                KVChunkInfo(index=c.index, tokens=c.tokens, level=c.level, bytes=c.bytes) for c in load.chunks
            ],
            load_ms=round((t1 - t0) * 1000, 2),
            prefill_ms=round((t2 - t1) * 1000, 2),
            faults=load.faults,
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
