"""One generation request on the step loop: its prompt's prefill in chunks, then a token per step.

The step loop asks each ``Generation`` for its next segment (``segment``) and
hands back the logits that segment produced (``advance``), then the token the
batched sampler drew for it (``accept``). Everything a request sees comes out
of here through ``emit``, on the model thread:
``PromptDone`` when the prompt is processed, ``TokenEvent`` per token,
``Finished`` at the end. Events carry token ids: text, stop strings and the
strings of logprob entries are made off the model thread, by the consumer
(``scheduler.text_stream``). Sampling uses the request's own generator, so a seed
gives the same tokens whatever else shares the step.
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
from engine.ragged import Segment
from engine.sampling import SamplingParams, TokenHistory, adjust_logits, make_generator
from scheduler.flag import Flag
from scheduler.prefix_load import ChunkReport, KVRequest
from scheduler.tenancy import PUBLIC, KeySpace


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
    # tokenization and waiting for memory and the model count against it
    admitted: float = field(default_factory=time.perf_counter)
    key_space: KeySpace = PUBLIC  # whose stored KV it reads and writes back
    # the choices of one request (``n``) share their prompt: the first sets ``prompt_ready`` when its
    # prompt's KV is in the prefix cache (or it ended), the others wait on it as ``after`` and hit it
    prompt_ready: Flag | None = None
    after: Flag | None = None

    @property
    def capacity(self) -> int:
        """Tokens of KV the request can hold at most: prompt and every generated token."""
        return len(self.prompt_ids) + self.max_tokens


@dataclass
class TokenLogprob:
    """A token's logprob and the top ones, by token id; the strings are filled in off the model
    thread (``scheduler.text_stream``)."""

    token_id: int
    logprob: float | None
    top_ids: list[tuple[int, float]] | None  # (token id, logprob), most likely first
    token: str = ""
    top: dict[str, float] | None = None


@dataclass
class PrefixReport:
    """Where the prompt's KV came from, and what it cost."""

    cached_tokens: int  # from the store or from memory
    recomputed_tokens: int  # prefilled: text chunks and everything after the prefix
    chunks: list[ChunkReport]
    load_ms: float  # lookup, fetch, decode and text chunks
    prefill_ms: float  # the prefill after the prefix, from its first step to its last
    faults: list[str]
    bandwidth_bps: float | None = None  # the link estimate, bytes per second
    budget_ms: float | None = None
    planned_ms: float | None = None  # what the first plan predicted for the prompt
    prompt_ms: float = 0.0  # arrival to first-token logits: what the budget is held to
    memory_tokens: int = 0  # of ``cached_tokens``, those from KV in memory (prefix cache)

    @property
    def slo_met(self) -> bool | None:
        return None if self.budget_ms is None else self.prompt_ms <= self.budget_ms


@dataclass
class PromptDone:
    kv_info: PrefixReport
    prompt_logprobs: list[TokenLogprob] | None


@dataclass
class TokenEvent:
    token_id: int
    logprob: TokenLogprob | None
    text: str = ""  # text released by this token (may be empty while held back): see ``text_stream``


@dataclass
class Finished:
    reason: str  # "stop", "length" or "abort"
    completion_tokens: int
    text_tail: str = ""  # text held back until the end


class Generation:
    """A request's state on the model thread. Its KV is ``shared`` (read-only parts attached from
    the prefix cache, possibly none), then its own buffer ``kv``; together they hold the first
    ``cached`` prompt tokens."""

    def __init__(
        self,
        job: GenerationJob,
        runner: ModelRunner,
        kv: torch.Tensor,
        cached: int,
        report: PrefixReport,
        emit: Callable[[Any], None],
        cancel: threading.Event,
        on_prefilled: Callable[[Generation], None] = lambda g: None,
        on_finished: Callable[[Generation], None] = lambda g: None,
        shared: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.job = job
        self.runner = runner
        self.kv = kv
        self.shared = shared
        self.cached = cached
        self.position = cached  # tokens whose KV is in ``kv``
        self.report = report
        self.emit = emit
        self.cancel = cancel
        self.on_prefilled = on_prefilled
        self.on_finished = on_finished
        self.generator = make_generator(job.sampling.seed, runner.device)
        self.history: TokenHistory | None = None  # made at the first token, when the vocabulary is known
        self.prompt_lp: list[TokenLogprob] | None = [] if job.prompt_logprobs is not None else None
        self._previous_row: torch.Tensor | None = None  # the last prompt-logprobs row of the last segment
        self.last_token: int | None = None  # sampled, its KV not yet computed
        self.produced = 0
        self.generated: list[int] = []
        self.prefill_started: float | None = None
        self.prefill_alone = True  # no other work shared its steps: its time is a clean measurement
        self.done = False
        self.failed = False  # ended by an exception: its KV cannot be trusted

    @property
    def computed_ids(self) -> list[int]:
        """The tokens whose KV is computed: the prompt, then every generated token fed back."""
        return (self.job.prompt_ids + self.generated)[: self.position]

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        """The request's KV in order: the shared parts, then its own buffer."""
        return (*self.shared, self.kv)

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.job.prompt_ids)

    def segment(self, budget: int) -> Segment | None:
        """The next step's work: up to ``budget`` prompt tokens, or the last sampled token."""
        prompt = self.job.prompt_ids
        if not self.prefilling:
            assert self.last_token is not None
            return Segment(self.kv, self.position, [self.last_token], shared=self.shared, decode=True)
        if budget <= 0:
            return None
        end = min(len(prompt), self.position + budget)
        logits = "all" if self.prompt_lp is not None else ("last" if end == len(prompt) else "none")
        if self.prefill_started is None:
            self.prefill_started = time.perf_counter()
        return Segment(self.kv, self.position, prompt[self.position : end], logits, self.shared)

    def advance(self, segment: Segment, logits: torch.Tensor | None, alone: bool) -> torch.Tensor | None:
        """Take a step's result; emits events. Returns the logits the next token is sampled from
        (the step loop samples every request's token at once, and hands it to ``accept``), or None
        when the step produced no token (a prefill that is not done, an echo-only request)."""
        was_prefilling = self.prefilling
        self.position = segment.end
        if not was_prefilling:
            assert logits is not None
            return logits
        self.prefill_alone = self.prefill_alone and alone
        if self.prompt_lp is not None:
            assert logits is not None
            self._prompt_logprobs(segment, logits)
            logits = logits[-1]
        if self.prefilling:
            return None
        assert logits is not None
        self._prompt_done()
        if self.job.max_tokens == 0:  # echo only
            self.finish("length")
            return None
        return logits

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """What the next token is sampled from: the logits after the request's penalties and biases."""
        sampling = self.job.sampling
        if not sampling.adjusts_logits:
            return logits
        if self.history is None:
            self.history = TokenHistory(logits.shape[-1], self.job.prompt_ids, logits.device)
        return adjust_logits(logits, sampling, self.history)

    def accept(self, token: int, logits: torch.Tensor) -> None:
        """The token sampled from ``logits`` (what ``advance`` returned): emit it, or end here."""
        job = self.job
        if self.history is not None:
            self.history.add(token)
        if token in self.runner.eos_token_ids and not job.sampling.ignore_eos:
            self.finish("stop")
            return
        self.produced += 1
        self.generated.append(token)
        self.last_token = token
        lp = self._token_logprob(token, logits, job.logprobs) if job.logprobs is not None else None
        self.emit(TokenEvent(token, lp))
        if self.produced >= job.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.emit(Finished(reason, self.produced))
        self.on_finished(self)

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self.failed = True
        self.emit(exc)
        self.on_finished(self)

    # -- internals ----------------------------------------------------------------------------

    def _prompt_done(self) -> None:
        now = time.perf_counter()
        self.report.prefill_ms = _ms(now - (self.prefill_started or now))
        self.report.prompt_ms = _ms(now - self.job.admitted)
        self.on_prefilled(self)
        self.emit(PromptDone(self.report, self.prompt_lp))

    def _token_logprob(self, token: int, logits: torch.Tensor, top: int) -> TokenLogprob:
        logprobs = torch.log_softmax(logits, dim=-1)
        return TokenLogprob(token, float(logprobs[token]), self._top(logprobs, top))

    def _prompt_logprobs(self, segment: Segment, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens up to this segment's end; None where no logits exist
        (the first token, tokens whose KV came from the store)."""
        assert self.prompt_lp is not None and self.job.prompt_logprobs is not None
        prompt = self.job.prompt_ids
        logprobs = torch.log_softmax(logits, dim=-1)
        while len(self.prompt_lp) < segment.end:
            pos = len(self.prompt_lp)
            token = prompt[pos]
            row = pos - 1 - segment.start  # the row of this segment's logits that predicted ``token``
            if pos == 0 or pos <= self.cached or row < -1:
                self.prompt_lp.append(TokenLogprob(token, None, None))
                continue
            source = self._previous_row if row == -1 else logprobs[row]
            assert source is not None
            value = float(source[token])
            self.prompt_lp.append(
                TokenLogprob(
                    token,
                    value if math.isfinite(value) else -9999.0,
                    self._top(source, self.job.prompt_logprobs),
                )
            )
        self._previous_row = logprobs[-1]  # predicts the first token of the next segment

    @staticmethod
    def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]] | None:
        if k <= 0:
            return None
        values, ids = torch.topk(logprobs, k)
        return list(zip(ids.tolist(), values.tolist()))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
