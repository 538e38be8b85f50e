"""The gateway's long-lived parts and the request glue the routes share (``app/build.py`` makes them)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.admission import Admission
from app.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from app.metrics import Metrics
from app.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    KVCacheInfo,
    KVChunkInfo,
    PromptTokensDetails,
    Usage,
)
from app.settings import Settings
from codec import Level, level_by_name
from codec.levels import (
    DEFAULT_LEVELS,
    V4_TABLE_FILE,
    default_level_table,
    level_transforms,
    load_level_table,
    shipped_level_table,
)
from codec.transform import cheap_inverse
from engine import ModelRunner
from engine.sampling import SamplingParams
from scheduler.collection_lease import CollectionLease
from scheduler.contexts import ContextStore
from scheduler.executor import RequestExecutor
from scheduler.flag import Flag
from scheduler.geometry import KVGeometry
from scheduler.generation import Finished, GenerationJob, PrefixReport, PromptDone, TokenEvent
from scheduler.kv_memory import KVMemory
from scheduler.lifecycle import CollectReport, StoreCollector
from scheduler.planner import TEXT
from scheduler.prefix_load import KVRequest
from scheduler.step_loop import StepLoop
from scheduler.text_stream import TextStream
from storage import ObjectStore

log = logging.getLogger(__name__)

GenerationRequest = ChatCompletionRequest | CompletionRequest
Disconnected = Callable[[], Awaitable[bool]]
DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED = 499  # nginx's status for a request whose client went away; nobody reads it


@dataclass(frozen=True)
class LevelTable:
    levels: tuple[Level, ...]  # best quality first
    floor: Level  # auto without a budget uses no level below this
    distortion: dict[str, float]  # quality loss per level, for the planner (0 = exact)


def builtin_table(device_type: str, geometry: KVGeometry | None = None) -> dict[str, Any]:
    """The built-in table for a model on ``device_type``: the transform levels (format 5) where
    their inverse transform (a 1.1-GFLOP matmul a 256-token chunk) is cheap, on a GPU or on a CPU
    with a native bf16 matmul (``codec.transform.cheap_inverse``), and where their transform fits
    the model's KV (``geometry``, when known); else the format-4 levels, which fit any model.

    On 2 cores with AMX a stored 4K context at 200 Mbit/s loads in 0.59 s with the transform
    levels against 0.79 s with format 4's since the CPU inverse became one pass (docs/codec.md,
    "TTFT over a link"); before, format 4's were faster there. A CPU without native bf16 multiplies
    in float32, 4x slower (docs/codec.md, "Speed")."""
    table = default_level_table()
    fits = geometry is None or all(
        (t.layers, t.kv_heads, t.head_dim) == (geometry.layers, geometry.kv_heads, geometry.head_dim)
        for t in level_transforms(DEFAULT_LEVELS).values()  # the default table, loaded
    )
    return table if cheap_inverse(device_type) and fits else shipped_level_table(V4_TABLE_FILE)


def load_levels(
    settings: Settings, device_type: str = "cpu", geometry: KVGeometry | None = None
) -> LevelTable:
    """The level table (``levels_file``, else ``builtin_table``); the quality floor of ``auto``
    without a budget; each level's distortion.

    The floor is ``min_quality`` when set; else the table's ``default_level``;
    else the middle one of its lossy levels. Distortion is the KL divergence the
    calibration measured per level when the table has it for every lossy level,
    else a stand-in that grows 4x per level, as measured tables do.
    """
    table = (
        builtin_table(device_type, geometry)
        if settings.levels_file is None
        else json.loads(settings.levels_file.read_text())
    )
    levels = load_level_table(table, None if settings.levels_file is None else settings.levels_file.parent)
    lossy = [lv for lv in levels if not lv.lossless] or list(levels)
    name = settings.min_quality or table.get("default_level") or lossy[len(lossy) // 2].name
    try:
        floor = level_by_name(name, levels)
    except KeyError:
        known = ", ".join(lv.name for lv in levels)
        raise ValueError(f"min_quality {name!r} is not a level of the table ({known})") from None
    measured = (table.get("calibration") or {}).get("measured") or {}
    kl = {lv.name: (measured.get(lv.name) or {}).get("kl") for lv in levels if not lv.lossless}
    if all(isinstance(v, int | float) and v >= 0 for v in kl.values()):
        distortion = {lv.name: 0.0 if lv.lossless else float(kl[lv.name]) for lv in levels}
    else:
        distortion = {lv.name: 0.0 if lv.lossless else 4.0**rank - 1 for rank, lv in enumerate(levels)}
    return LevelTable(levels, floor, distortion)


@dataclass
class Gateway:
    settings: Settings
    runner: ModelRunner
    store: ObjectStore
    contexts: ContextStore
    executor: RequestExecutor
    admission: Admission
    loop: StepLoop
    memory: KVMemory
    metrics: Metrics
    table: LevelTable
    io_pool: ThreadPoolExecutor
    profile_file: Path  # the cost profile, written back at shutdown with what serving learned
    collector: StoreCollector
    store_levels: tuple[
        Level, ...
    ]  # stored when no setting or request names levels (scheduler/store_levels.py)

    def __post_init__(self) -> None:
        self._collecting = threading.Lock()
        self._show_link = shows_link(self.settings)

    def kv_cache_info(self, report: PrefixReport) -> dict[str, Any]:
        """The response's ``kv_cache_info`` extension object."""
        return kv_cache_info(report, show_link=self._show_link, replica=self.settings.replica)

    def collect(self) -> CollectReport | None:
        """One garbage collection and cap pass (blocking; None when one is already running)."""
        if not self._collecting.acquire(blocking=False):
            return None
        try:
            report = self.collector.collect()
        finally:
            self._collecting.release()
        m = self.metrics
        m.collections.inc()
        m.store_bytes.set(report.store_bytes)
        m.contexts_expired.inc(report.expired_contexts)
        m.gc_objects.inc(report.deleted_objects)
        m.contexts_evicted.inc(len(report.evicted_contexts))
        m.evicted_bytes.inc(report.evicted_bytes)
        if report.deleted_objects or report.expired_contexts or report.evicted_contexts:
            log.info("store collection: %s", report.as_dict())
        return report

    def collect_if_leased(self, lease: CollectionLease) -> CollectReport | None:
        """The periodic sweep: one pass when this replica holds the store's collection lease
        (``scheduler/collection_lease.py``), else None."""
        if not lease.acquire():
            log.debug("store collection skipped: another replica holds the lease")
            return None
        return self.collect()

    @property
    def collect_interval_s(self) -> float | None:
        """How often the gateway collects: the setting; with a cap and no setting, every 5 minutes."""
        if self.settings.gc_interval_s is not None:
            return self.settings.gc_interval_s
        return 300.0 if self.settings.store_max_bytes is not None else None

    @property
    def levels(self) -> tuple[Level, ...]:
        return self.table.levels

    @property
    def model_name(self) -> str:
        return self.runner.loaded.name

    @property
    def max_context(self) -> int:
        """The context window: the model's, or less with ``max_model_len``."""
        return min(self.runner.max_context, self.settings.max_model_len or self.runner.max_context)

    # -- request checks ---------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.settings.model):
            raise ModelNotFound(
                f"model {name!r} does not exist; this gateway serves {self.model_name!r}", param="model"
            )

    def kv_request(self, quality: str, use_kv: bool, slo_ms: float | None) -> KVRequest | None:
        """How a request may use stored KV: ``auto`` plans per chunk; a level name is used as is."""
        if not use_kv:
            return None
        distortion = self.table.distortion
        if quality != "auto":
            try:
                return KVRequest([level_by_name(quality, self.levels)], distortion, fixed=True)
            except KeyError:
                names = ", ".join(["auto", *(lv.name for lv in self.levels)])
                raise InvalidRequest(
                    f"unknown kv_quality {quality!r}; use one of: {names}", param="kv_quality"
                ) from None
        slo_ms = slo_ms if slo_ms is not None else self.settings.kv_slo_ms
        if slo_ms is not None:
            return KVRequest(list(self.levels), distortion, budget_s=slo_ms / 1000)
        # Without a budget, no text: the plan's overlap of recompute with the link proved
        # optimistic on few cores (text and medium took 3.4 s at 50 Mbps, medium alone 2.4 s)
        floor = self.levels.index(self.table.floor)
        return KVRequest(list(self.levels[: floor + 1]), distortion, allow_text=False)

    def encode_levels(self, names: list[str] | None) -> list[Level]:
        """The levels a pre-encode writes: the request's, else the settings', else the stored default."""
        names = list(dict.fromkeys(names or self.settings.encode_levels or []))
        if not names:
            return list(self.store_levels)
        try:
            return pick_levels(self.levels, names)
        except ValueError:
            known = ", ".join(lv.name for lv in self.levels)
            raise InvalidRequest(f"unknown level in {names}; known: {known}", param="levels") from None

    def token_budget(
        self, prompt_len: int, requested: int | None, *, prompt_param: str, max_param: str = "max_tokens"
    ) -> int:
        """max_tokens after the context-window checks. ``prompt_param`` and ``max_param`` name the
        request's fields (``messages`` or ``prompt``; ``max_tokens`` or ``max_completion_tokens``)."""
        if prompt_len >= self.max_context:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_context} tokens; "
                f"the prompt has {prompt_len}",
                param=prompt_param,
            )
        room = self.max_context - prompt_len
        if requested is None:
            return min(room, self.settings.default_max_tokens)
        if requested > room:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{prompt_len} and {max_param} asks for {requested}",
                param=max_param,
            )
        return requested

    # -- tokenization -----------------------------------------------------------------------------

    def chat_token_ids(self, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages
        ]
        try:
            text = self.runner.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors for conversations a template refuses
            raise InvalidRequest(f"the model's chat template rejects these messages: {exc}", param="messages")
        return self.text_token_ids(text, add_special_tokens=False)

    def text_token_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.runner.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def warn_ignored(self, fields: list[str]) -> None:
        """Unknown request fields are accepted and ignored, as vLLM does, and named in the log:
        escaped (a name is client text: no newline or control character reaches the log), each cut
        to 64 characters, at most 16 of them."""
        if fields:
            shown = [json.dumps(f[:64]) for f in fields[:16]]
            more = f" and {len(fields) - 16} more" if len(fields) > 16 else ""
            log.warning("ignoring unknown request fields: %s%s", ", ".join(shown), more)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = len(self.runner.tokenizer)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (size {vocab})", param=param)

    # -- running jobs -----------------------------------------------------------------------------

    def jobs(
        self, request: GenerationRequest, prompt_ids: list[int], max_tokens: int | None, **extra: Any
    ) -> list[GenerationJob]:
        """A request's jobs, one per choice (``n``), after the checks every endpoint shares
        (kv_quality, window, biases). With a seed, choice ``i`` samples with ``seed + i``."""
        job = self._job(request, prompt_ids, max_tokens, **extra)
        if request.n == 1:
            return [job]
        seeds = [None if request.seed is None else request.seed + i for i in range(request.n)]
        jobs = [replace(job, sampling=replace(job.sampling, seed=seed)) for seed in seeds]
        if self.settings.prefix_cache and job.kv is not None:
            # the first choice prefills the prompt; the others find it in memory (scheduler/executor.py)
            ready = Flag()
            jobs = [replace(jobs[0], prompt_ready=ready), *(replace(j, after=ready) for j in jobs[1:])]
        return jobs

    def _job(
        self, request: GenerationRequest, prompt_ids: list[int], max_tokens: int | None, **extra: Any
    ) -> GenerationJob:
        self.warn_ignored(request.ignored_fields())
        bias = request.logit_bias or {}
        self.check_token_ids(list(bias), "logit_bias")
        if isinstance(request, CompletionRequest):
            prompt_param, max_param = "prompt", "max_tokens"
        else:
            prompt_param = "messages"
            max_param = "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens"
        return GenerationJob(
            prompt_ids=prompt_ids,
            max_tokens=self.token_budget(
                len(prompt_ids), max_tokens, prompt_param=prompt_param, max_param=max_param
            ),
            sampling=SamplingParams(
                temperature=request.temperature,
                top_p=request.top_p,
                seed=request.seed,
                ignore_eos=request.ignore_eos,
                presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty,
                repetition_penalty=request.repetition_penalty,
                logit_bias=tuple(sorted(bias.items())),
            ),
            stops=request.stop_list(),
            kv=self.kv_request(request.kv_quality, request.kv_cache, request.kv_slo_ms),
            **extra,
        )

    def events(self, job: GenerationJob) -> TextStream:
        """Admit the job and run it; its events, with their text made here, off the model thread."""
        self.executor.check(job)
        stream = self.admission.stream(lambda emit, cancel: self.executor.start(job, emit, cancel))
        return TextStream(stream, self.runner.tokenizer, job.stops)

    def admit_all(self, jobs: list[GenerationJob]) -> list[TextStream]:
        """Admit every job, or none: a job that is refused closes the ones admitted before it."""
        streams: list[TextStream] = []
        try:
            for job in jobs:
                streams.append(self.events(job))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    def observe(
        self, endpoint: str, started: float, prompt: PromptDone | None, finished: Finished | None
    ) -> None:
        m = self.metrics
        if prompt is not None:
            info = prompt.kv_info
            m.prompt_tokens.inc(info.recomputed_tokens)
            m.memory_prefix_hits.inc(info.memory_tokens)
            for fault in info.faults:
                m.kv_store_faults.labels(fault).inc()
            if info.chunks:
                m.kv_load_seconds.observe(info.load_ms / 1000)
            for chunk in info.chunks:
                m.kv_chunks.labels(chunk.level or TEXT).inc()
                if chunk.source == "text":
                    m.kv_chunks_recomputed.inc()
                    m.kv_chunk_seconds.labels("prefill").observe(chunk.prefill_ms / 1000)
                else:
                    m.kv_bytes_loaded.labels(chunk.level).inc(chunk.bytes)
                    m.kv_chunk_seconds.labels("fetch").observe(chunk.fetch_ms / 1000)
                    m.kv_chunk_seconds.labels("decode").observe(chunk.decode_ms / 1000)
            if info.bandwidth_bps is not None:
                m.kv_bandwidth.set(info.bandwidth_bps)
            if info.slo_met is not None:
                m.kv_slo.labels("met" if info.slo_met else "missed").inc()
        if finished is not None:
            m.generation_tokens.inc(finished.completion_tokens)
            m.requests.labels(endpoint, finished.reason).inc()
            m.e2e_latency.observe(time.perf_counter() - started)

    def record_lookup(self, prompt_len: int, cached: int, used_store: bool) -> None:
        if used_store:
            self.metrics.prefix_queries.inc(prompt_len)
            self.metrics.prefix_hits.inc(cached)


def shows_link(settings: Settings) -> bool:
    """Whether responses carry the link estimate. It is the whole process's traffic: with tenants,
    one tenant's response would show another's activity, so it stays in /metrics (behind
    ``metrics_auth`` if set)."""
    return not settings.api_keys() or settings.shared_cache


def kv_cache_info(report: PrefixReport, show_link: bool = True, replica: str | None = None) -> dict[str, Any]:
    """The response's ``kv_cache_info`` extension object; ``show_link``: with the link estimate;
    ``replica``: the name of the gateway that answered."""
    return KVCacheInfo(
        cached_tokens=report.cached_tokens,
        memory_tokens=report.memory_tokens,
        recomputed_tokens=report.recomputed_tokens,
        chunks=[KVChunkInfo(**vars(c)) for c in report.chunks],
        load_ms=report.load_ms,
        prefill_ms=report.prefill_ms,
        faults=report.faults,
        bandwidth_mbps=None
        if report.bandwidth_bps is None or not show_link
        else round(report.bandwidth_bps * 8 / 1e6, 1),
        budget_ms=report.budget_ms,
        planned_ms=report.planned_ms,
        prompt_ms=report.prompt_ms,
        slo_met=report.slo_met,
        replica=replica,
    ).model_dump()


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


@dataclass
class Outcome:
    """A finished non-streaming job."""

    prompt: PromptDone
    tokens: list[TokenEvent]
    finished: Finished

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens) + self.finished.text_tail


async def observed_events(
    gateway: Gateway, endpoint: str, job: GenerationJob, events: AsyncIterator[Any] | None = None
) -> AsyncIterator[Any]:
    """The job's events, with the request's metrics (lookup, TTFT, totals) recorded on the way."""
    started = time.perf_counter()
    prompt: PromptDone | None = None
    finished: Finished | None = None
    first_token = True
    events = events if events is not None else gateway.events(job)
    try:
        async for event in events:
            if isinstance(event, PromptDone):
                prompt = event
                gateway.record_lookup(len(job.prompt_ids), event.kv_info.cached_tokens, job.kv is not None)
            elif isinstance(event, TokenEvent) and first_token:
                gateway.metrics.ttft.observe(time.perf_counter() - started)
                first_token = False
            elif isinstance(event, Finished):
                finished = event
            yield event
    finally:
        await events.aclose()
        gateway.observe(endpoint, started, prompt, finished)


async def collect(
    gateway: Gateway, endpoint: str, jobs: list[GenerationJob], disconnected: Disconnected | None = None
) -> list[Outcome] | None:
    """Run jobs (a request's ``n`` choices) to the end, for non-streaming requests.

    Every job is admitted before any runs (a 429 admits none). ``disconnected``
    is polled while they run: a client that went away cancels them (their batch
    slots and KV memory free at the next step), and the answer is None.
    """

    async def run(job: GenerationJob, events: AsyncIterator[Any]) -> Outcome:
        prompt: PromptDone | None = None
        tokens: list[TokenEvent] = []
        finished: Finished | None = None
        async for event in observed_events(gateway, endpoint, job, events):
            if isinstance(event, PromptDone):
                prompt = event
            elif isinstance(event, TokenEvent):
                tokens.append(event)
            elif isinstance(event, Finished):
                finished = event
        assert prompt is not None and finished is not None
        return Outcome(prompt, tokens, finished)

    streams = gateway.admit_all(jobs)  # admission and its errors (429, 400) happen here
    task = asyncio.ensure_future(asyncio.gather(*(run(job, events) for job, events in zip(jobs, streams))))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return list(task.result())
        if disconnected is not None and await disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def pick_levels(levels: tuple[Level, ...], names: list[str] | None) -> list[Level]:
    """The levels ``names`` names, in that order (all of ``levels`` when none); ValueError for an unknown one."""
    if not names:
        return list(levels)
    try:
        return [level_by_name(n, levels) for n in names]
    except KeyError as exc:
        raise ValueError(f"unknown level {exc.args[0]!r} in settings") from None
