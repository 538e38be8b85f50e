"""Load a stored prefix into the model's KV buffer, chunk by chunk, as a pipeline.

Each chunk's source is the store at some level, or ``text`` (prefill that
chunk on top of the KV before it). Fetches run ahead on the I/O pool, a few
chunks at a time, while the calling thread decodes the chunk before them into
its slice of one preallocated buffer, or prefills a text chunk. In ``auto``
mode the plan for the chunks not yet fetched is made again before each
chunk, from the time left, the measured bandwidth and the cost profile; a
level a client names is used for every chunk, without re-planning.

Any fault (a missing or unreadable object, bytes the codec rejects, a shape
that does not fit the model) ends the prefix at the chunk before it: the
caller prefills the rest from text, and the fault is reported, not served.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from codec import (
    CodecError,
    KVTransform,
    Level,
    ParsedBatch,
    ParsedChunk,
    ShapeMismatch,
    StreamError,
    decode_into,
    level_digest,
    max_chunk_bytes,
    parse_chunk,
    raw_chunk_bytes,
)
from scheduler.bandwidth import LinkRates
from scheduler.futures import when_all
from scheduler.geometry import KVGeometry
from scheduler.layout import chunk_object_key
from scheduler.planner import TEXT, ChunkCosts, PlanInputs, plan
from scheduler.prefix_load import ChunkReport, KVRequest, KVTarget, PrefixLoad
from scheduler.profile import CostProfile
from scheduler.stored import StoredChunk, StoredPrefix
from storage import ObjectNotFound, ObjectStore, ObjectTooLarge, StorageError

log = logging.getLogger(__name__)

# Assumed link rate until this process has measured one (100 Mbit/s), unless the store knows
# better (a local directory: ``ObjectStore.prior_bytes_per_second``): the first request's first
# chunks are planned with it; text is not chosen on it.
PRIOR_BYTES_PER_SECOND = 12.5e6
_SLOWDOWN_EWMA = 0.3
BUDGET_SHARE = 0.8
# Store chunks decoded together at most: what has arrived when the decoder gets to it, so that a
# GPU decodes many chunks' streams in one launch (16 x 360 streams of the default model).
MAX_BATCH = 16
FETCH_WINDOW = 2  # store chunks in flight once the link has been measured


@dataclass
class _TextRun:
    """Consecutive text chunks ``[first, end)``, prefilling on the model while the load goes on."""

    first: int
    end: int
    future: Future[bool]  # True: prefilled; False: cancelled first
    submitted: float
    predicted_s: float
    finished: float = 0.0


@dataclass
class _Fetched:
    data: bytes | memoryview  # a view of a staging buffer, or the store's own bytes
    issued: float
    arrived: float


class PrefixLoader:
    def __init__(
        self,
        store: ObjectStore,
        geometry: KVGeometry,
        pool: ThreadPoolExecutor,
        profile: CostProfile,
        window: int = FETCH_WINDOW,
        codec_gate: AbstractContextManager[Any] | None = None,
        transforms: Mapping[bytes, KVTransform] | None = None,
        staging: Callable[[int], memoryview | None] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        self.store = store
        # a whole chunk's tokens: a shorter one teaches the cost profile its share of one (None: the
        # longest chunk of each load)
        self.chunk_size = chunk_size
        # where fetched chunks are read into, when the store can (``ObjectStore.get_into``): the KV
        # pool's blocks, already resident (``engine.kv_pool``); None from it: the store's own bytes
        self.staging = staging
        # the transforms scheme-4 chunks may name: the level table's (None: every loaded table's)
        self.transforms = transforms
        # held around each decode: the codec's CPU work of all requests shares the thread budget
        self.codec_gate = codec_gate or nullcontext()
        self.geometry = geometry
        self.pool = pool
        self.profile = profile
        self.window = window  # store chunks in flight once the link has been measured
        self.bandwidth = LinkRates()  # overall, and per level (small transfers read a lower rate)
        # actual / planned time of recent requests: a budget is planned against budget / slowdown,
        # so what the cost model misses (a busier machine, per-request overheads) is allowed for
        self.slowdown = 1.0
        self._lock = threading.Lock()

    def load(
        self,
        target: KVTarget,
        stored: StoredPrefix,
        token_ids: Sequence[int],
        request: KVRequest,
        prompt_tokens: int,
        started: float,
        cancel: threading.Event | None = None,
        capacity: int | None = None,
        staging_bytes: int | None = None,
    ) -> PrefixLoad:
        """``start``, waited for."""
        return self.start(
            target, stored, token_ids, request, prompt_tokens, started, cancel, capacity, staging_bytes
        ).result()

    def start(
        self,
        target: KVTarget,
        stored: StoredPrefix,
        token_ids: Sequence[int],
        request: KVRequest,
        prompt_tokens: int,
        started: float,
        cancel: threading.Event | None = None,
        capacity: int | None = None,
        staging_bytes: int | None = None,
    ) -> Future[PrefixLoad]:
        """Load ``stored`` into a new KV buffer of ``capacity`` tokens (default: the prefix's):
        size it for the whole request, and the model's cache grows inside it.

        Fetches and decodes on the calling thread, and returns when the store's chunks are in;
        the future is done when the text chunks' prefill on the model is too (it may be done on
        return), or raises the load's error once no prefill writes into the buffer any more.

        ``staging_bytes`` (default: ``staging_bytes`` of the longest chunk; what the caller reserved
        for it) bounds the fetched bytes held at once. One chunk is always fetched, so 0 means one
        at a time."""
        if staging_bytes is None:
            staging_bytes = self.staging_bytes(max((c.tokens for c in stored.chunks), default=0))
        run = _LoadRun(self, target, stored, token_ids, request, prompt_tokens, started, staging_bytes)
        return run.execute(cancel or threading.Event(), capacity)

    def staging_bytes(self, chunk_tokens: int) -> int:
        """The most fetched bytes one load of ``chunk_tokens``-token chunks holds at once (in flight,
        arrived, being decoded): the window and the chunk being decoded, each as large as a
        lossless float32 chunk. A fast store finishes fetches before the decoder gets to them, and counting
        only transfers in flight let one load hold its whole prefix's chunks (issue 19, finding 6)."""
        return (self.window + 1) * raw_chunk_bytes(self.geometry.chunk_shape(chunk_tokens))

    def observe_outcome(self, planned_s: float | None, actual_s: float) -> None:
        """How long a planned request really took: plans after it allow for the difference."""
        if planned_s is None or planned_s <= 0:
            return
        ratio = min(max(actual_s / planned_s, 0.8), 3.0)
        with self._lock:
            self.slowdown = (1 - _SLOWDOWN_EWMA) * self.slowdown + _SLOWDOWN_EWMA * ratio

    def fetch(self, chunk: StoredChunk, level: Level) -> _Fetched:
        key = chunk_object_key(chunk.key, level.name, level_digest(level))
        metered = not chunk.resident.get(level.name, False)
        issued = self.bandwidth.begin()
        received = 0
        cpu = time.thread_time()
        limit = max_chunk_bytes(self.geometry.chunk_shape(chunk.tokens))
        size = chunk.sizes.get(level.name, 0)
        buffer = self.staging(size + 1) if self.staging is not None and 0 < size <= limit else None
        try:  # one byte more than the index says, so a read into the buffer sees the object's end
            data = self.store.get(key, limit) if buffer is None else self.store.get_into(key, buffer, limit)
            received = len(data)
        finally:
            if metered:
                self.bandwidth.end(issued, received, level.name)
        if metered and received:
            self.profile.observe_receive(received, time.thread_time() - cpu)
        return _Fetched(data, issued, time.perf_counter())


class _LoadRun:
    """One request's load: the plan, the fetches in flight, the buffer."""

    def __init__(
        self,
        loader: PrefixLoader,
        target: KVTarget,
        stored: StoredPrefix,
        token_ids: Sequence[int],
        request: KVRequest,
        prompt_tokens: int,
        started: float,
        staging_bytes: int,
    ) -> None:
        self.loader = loader
        self.target = target
        self.chunks = stored.chunks
        self.token_ids = token_ids
        self.request = request
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.by_name = {lv.name: lv for lv in request.levels}
        n = len(self.chunks)
        self.sources: list[str | None] = [request.levels[0].name] * n if request.fixed else [None] * n
        self.pending: dict[int, Future[_Fetched]] = {}
        self.staging_bytes = staging_bytes  # fetched bytes held at once at most (beyond one chunk)
        self.decoding_bytes = 0  # of fetched chunks taken out of ``pending`` and not yet decoded
        self.committed = 0  # chunks [0, committed) have a final source (fetch issued, or text)
        # the link rate when text was last planned: each plan puts its text chunks first among
        # the chunks left, so re-planning with text allowed every time stacks text chunk on text
        # chunk (6 of 17 at 50 Mbps, 4 s where medium alone took 2.3 s). Text comes back only
        # when the link has since halved.
        self.text_rate: float | None = None
        self.text_runs: list[_TextRun] = []  # in chunk order
        self.result = PrefixLoad(kv=None, faults=list(stored.faults))

    def execute(self, cancel: threading.Event, capacity: int | None) -> Future[PrefixLoad]:
        prefix = self.chunks[-1].end if self.chunks else 0
        kv = self.target.new_kv(max(prefix, capacity or 0)) if self.chunks else None
        loaded = 0
        i = 0
        error: BaseException | None = None
        try:
            while i < len(self.chunks) and not cancel.is_set():
                if i >= self.committed:
                    self._advance(i)
                done, more = self._consume(i, kv)
                if done:
                    loaded = self.chunks[i + done - 1].end
                i += done
                if not more:
                    break
        except BaseException as exc:  # noqa: BLE001 - raised from the future once the text runs end
            error = exc
        finally:
            for future in self.pending.values():
                future.cancel()
        result: Future[PrefixLoad] = Future()

        def finish() -> None:  # on the thread that ends the last text run (the model thread)
            try:
                if error is not None:
                    raise error
                tokens = self._finish_text(loaded)
                self.result.chunks.sort(key=lambda c: c.index)
                self.result.kv = kv if tokens else None
                self.result.tokens = tokens
                self.result.bandwidth_bps = self.loader.bandwidth.bytes_per_second
                result.set_result(self.result)
            except BaseException as exc:  # noqa: BLE001 - the future carries it to the caller
                result.set_exception(exc)

        when_all([run.future for run in self.text_runs], finish)
        return result

    # -- planning -----------------------------------------------------------------------------

    def _rate(self) -> tuple[float, bool]:
        measured = self.loader.bandwidth.bytes_per_second
        if measured:
            return measured, True
        return self.loader.store.prior_bytes_per_second or PRIOR_BYTES_PER_SECOND, False

    def _replan(self, current: int) -> None:
        if self.committed >= len(self.chunks):
            return
        profile = self.loader.profile
        rate, measured = self._rate()
        names = [lv.name for lv in self.request.levels]
        rates = self.loader.bandwidth.for_levels(names, rate, self.loader.store.prior_bytes_per_second)
        link_busy = 0.0
        now = time.perf_counter()
        # text runs still prefilling hold the model: what the profile gives them is left
        compute_busy = sum(
            max(run.predicted_s - (now - run.submitted), 0.0)
            for run in self.text_runs
            if not run.future.done()
        )
        for j in range(current, self.committed):
            chunk, source = self.chunks[j], self.sources[j]
            assert source is not None
            if source == TEXT:
                compute_busy += profile.prefill_seconds(chunk.tokens, chunk.start)
                continue
            compute_busy += profile.decode_seconds(source, chunk.tokens)
            future = self.pending.get(j)
            if future is not None and not future.done() and not chunk.resident.get(source, False):
                link_busy += chunk.sizes[source] / rates[source]
        remaining = [
            ChunkCosts(
                bytes={n: 0 if c.resident.get(n) else c.sizes[n] for n in names if n in c.sizes},
                decode_s={
                    n: profile.decode_seconds(n, c.tokens)
                    + (0 if c.resident.get(n) else profile.receive_seconds(c.sizes.get(n, 0)))
                    for n in names
                },
                recompute_s=profile.prefill_seconds(c.tokens, c.start),
            )
            for c in self.chunks[self.committed :]
        ]
        prefix_end = self.chunks[-1].end
        budget = self.request.budget_s
        elapsed = time.perf_counter() - self.started
        chosen = plan(
            PlanInputs(
                chunks=remaining,
                levels=names,
                distortion=self.request.distortion,
                rate_bps=rate,
                level_rates_bps=rates,
                suffix_s=profile.prefill_seconds(self.prompt_tokens - prefix_end, prefix_end),
                link_busy_s=link_busy,
                compute_busy_s=compute_busy,
                # what the model predicts takes ``slowdown`` times longer, and a fifth of what is
                # left is kept back for what no model sees coming (a dip of the link, a busy core)
                budget_s=None if budget is None else BUDGET_SHARE * (budget - elapsed) / self.loader.slowdown,
                allow_text=self.request.allow_text
                and measured
                and (self.text_rate is None or rate < 0.5 * self.text_rate),
            )
        )
        if TEXT in chosen.sources:
            self.text_rate = rate
        log.debug(
            "plan at chunk %d: %s (predicted %.3f s, %.1f Mbit/s%s, budget left %s)",
            current,
            chosen.sources,
            chosen.predicted_s,
            rate * 8e-6,
            "" if measured else " assumed",
            None if budget is None else round(budget - elapsed, 3),
        )
        if self.result.planned_s is None and measured:  # a plan on the prior rate is no prediction
            self.result.planned_s = elapsed + chosen.predicted_s
        self.sources[self.committed :] = chosen.sources

    def _advance(self, current: int, busy_s: float = 0.0) -> None:
        """Plan the chunks not yet committed, and fill the fetch window from ``current`` on.

        ``busy_s``: the model thread is about to be busy this long (a text chunk), so enough
        fetches are issued to keep the link working until it comes back.
        """
        if not self.request.fixed:
            self._replan(current)
        self._issue(current, busy_s * self._rate()[0])

    def _issue(self, current: int, ahead_bytes: float = 0.0) -> None:
        """Commit chunks in order, fetching store chunks: at least ``window`` transfers in flight,
        and at least ``ahead_bytes`` fetched or in flight beyond what the model has consumed, as
        far as ``staging_bytes`` allows.

        Text chunks commit as soon as the pointer reaches them: the planner puts them first, so
        that later chunks are on the link while the model recomputes them.
        """
        # one fetch at a time on a link nobody has measured; a store that knows its rate (a local
        # directory) gets the whole window at once, so its first estimate is of reads that overlap
        # as all later ones do (one 11 MiB read from this VM's disk alone: 1.0 GB/s; two: 1.6)
        known = self.loader.bandwidth.bytes_per_second or self.loader.store.prior_bytes_per_second
        window = self.loader.window if known else 1
        while self.committed < len(self.chunks):
            source = self.sources[self.committed]
            assert source is not None
            if source != TEXT:
                ahead = [j for j in self.pending if j >= current]
                in_flight = sum(1 for j in ahead if not self.pending[j].done())
                queued = sum(self.chunks[j].sizes[self.sources[j]] for j in ahead)  # type: ignore[index]
                if in_flight >= window and queued >= ahead_bytes:
                    return
                chunk = self.chunks[self.committed]
                staged = self._staged()
                if staged and staged + chunk.sizes[source] > self.staging_bytes:
                    return
                self.pending[self.committed] = self.loader.pool.submit(
                    self.loader.fetch, chunk, self.by_name[source]
                )
            self.committed += 1

    def _staged(self) -> int:
        """Fetched bytes this load holds or has asked for: in flight, arrived, being decoded."""
        sizes = sum(self.chunks[j].sizes[self.sources[j]] for j in self.pending)  # type: ignore[index]
        return sizes + self.decoding_bytes

    # -- execution ----------------------------------------------------------------------------

    def _consume(self, i: int, kv: torch.Tensor) -> tuple[int, bool]:
        """Load chunk ``i``, and the store chunks right after it whose bytes are already here, in
        one decode. Returns how many chunks were loaded and whether to go on."""
        chunk = self.chunks[i]
        source = self.sources[i]
        assert source is not None
        if source == TEXT:
            # later chunks travel, and are decoded, while this one is recomputed
            self._advance(i + 1, self.loader.profile.prefill_seconds(chunk.tokens, chunk.start))
            end = i + 1
            while end < self.committed and self.sources[end] == TEXT:
                end += 1
            self._start_text(i, end, kv)
            return end - i, True
        waited = time.perf_counter()
        try:
            fetched = [self.pending.pop(i).result()]
        except ObjectNotFound:
            log.warning("KV chunk %d is listed in the index but missing from the store", i)
            self.result.faults.append("object_missing")
            self.result.bad_chunks.append(chunk.key)
            return 0, False
        except ObjectTooLarge as exc:
            log.warning(
                "KV chunk %d is larger than any chunk of its shape, recomputing from there: %s", i, exc
            )
            self.result.faults.append("oversized_chunk")
            self.result.bad_chunks.append(chunk.key)
            return 0, False
        except StorageError as exc:
            log.warning("KV chunk %d unreadable, recomputing from there: %s", i, exc)
            self.result.faults.append("store_unavailable")
            return 0, False
        idle = time.perf_counter() - waited
        fetched += self._arrived(i + 1)
        self.decoding_bytes = sum(len(f.data) for f in fetched)
        self._advance(i + len(fetched))  # the link is free for the next fetches while these decode
        queued = time.perf_counter()
        try:
            with self.loader.codec_gate:
                # the decode's own time, not the wait for the gate: other loads' decodes are no
                # cost of this level, and learning them as one (into the profile, which is saved
                # at shutdown) once made lossless look 50x dearer than it is after 8 loads at once
                t = time.perf_counter()
                decoded, fault = self._decode(i, fetched, kv)
                seconds = time.perf_counter() - t
        finally:
            self.decoding_bytes = 0
        if fault:
            self.result.faults.append(fault)
            self.result.bad_chunks.append(self.chunks[i + decoded].key)
        self._report(i, fetched[:decoded], seconds, idle, gate=t - queued)
        return decoded, fault is None

    def _start_text(self, first: int, end: int, kv: torch.Tensor) -> None:
        """Prefill text chunks ``[first, end)`` on the model, without waiting for it. A run reads
        the KV of every chunk before it, so it starts after the run before it (the store chunks
        between them are decoded by then: they are consumed in order)."""
        start, stop = self.chunks[first].start, self.chunks[end - 1].end
        predicted = self.loader.profile.prefill_seconds(stop - start, start)
        before = self.text_runs[-1].future if self.text_runs else None
        future = self.target.start_prefill(kv, start, list(self.token_ids[start:stop]), before)
        run = _TextRun(first, end, future, time.perf_counter(), predicted)
        future.add_done_callback(lambda _: setattr(run, "finished", time.perf_counter()))
        self.text_runs.append(run)

    def _finish_text(self, loaded: int) -> int:
        """Once every text run is over: how many tokens of the prefix hold KV, up to the first
        run that did not finish (a cancelled request), else ``loaded``. A failed prefill raises."""
        previous = 0.0  # when the run before ended: a run starts after it
        for run in self.text_runs:
            if not run.future.result():
                return min(loaded, self.chunks[run.first].start)
            chunks = self.chunks[run.first : run.end]
            tokens = sum(c.tokens for c in chunks)
            seconds = run.finished - max(run.submitted, previous)
            previous = run.finished
            self.loader.profile.observe_prefill(tokens, chunks[0].start, seconds)
            for k, chunk in enumerate(chunks):
                share = _ms(seconds * chunk.tokens / tokens)
                self.result.chunks.append(
                    ChunkReport(run.first + k, chunk.tokens, "text", None, prefill_ms=share)
                )
        return loaded

    def _arrived(self, j: int) -> list[_Fetched]:
        """The fetched bytes of store chunks ``j, j+1, ...`` as long as they are here, intact."""
        out = []
        while len(out) < MAX_BATCH - 1 and j < self.committed and self.sources[j] != TEXT:
            future = self.pending.get(j)
            if future is None or not future.done() or future.exception() is not None:
                break  # a failed fetch is reported when the loop gets to it
            out.append(self.pending.pop(j).result())
            j += 1
        return out

    def _decode(self, i: int, fetched: list[_Fetched], kv: torch.Tensor) -> tuple[int, str | None]:
        """Parse chunks ``i, i+1, ...`` and decode those before the first bad one into ``kv``, in one
        batch. Returns how many were decoded, and the fault that stopped them (or None)."""
        parsed: list[ParsedChunk] = []
        fault = None
        for k, f in enumerate(fetched):
            chunk = self.chunks[i + k]
            try:  # the shape is checked from the header, before the body is read or allocated
                p = parse_chunk(
                    f.data,
                    expect=self.loader.geometry.chunk_shape(chunk.tokens),
                    transforms=self.loader.transforms,
                )
            except ShapeMismatch as exc:
                log.warning("KV chunk %d does not fit the model, recomputing from there: %s", i + k, exc)
                fault = "shape_mismatch"
                break
            except CodecError as exc:
                log.warning("KV chunk %d rejected by the codec, recomputing from there: %s", i + k, exc)
                fault = "corrupt_chunk"
                break
            parsed.append(p)
        if not parsed:
            return 0, fault
        end = self.chunks[i + len(parsed) - 1].end
        try:
            decode_into(ParsedBatch(tuple(parsed)), kv[:, :, :, self.chunks[i].start : end])
        except StreamError as exc:
            log.warning("KV chunk %d rejected by the codec, recomputing from there: %s", i + exc.chunk, exc)
            return exc.chunk, "corrupt_chunk"
        return len(parsed), fault

    def _report(self, i: int, fetched: list[_Fetched], seconds: float, idle: float, gate: float) -> None:
        """One report per chunk of a batch; its decode time shared as the cost profile predicts."""
        profile = self.loader.profile
        loaded = [(self.chunks[i + k], self.sources[i + k], f) for k, f in enumerate(fetched)]
        weights = [profile.decode_seconds(source, c.tokens) for c, source, _ in loaded]  # type: ignore[arg-type]
        if sum(weights) <= 0:
            weights = [float(c.tokens) for c, _, _ in loaded]
        total = sum(weights)
        full = self.loader.chunk_size or max(c.tokens for c in self.chunks)  # a context's tail is shorter
        for k, ((chunk, source, f), w) in enumerate(zip(loaded, weights, strict=True)):
            assert source is not None
            share = seconds * w / total
            profile.observe_decode(source, chunk.tokens, share, full_tokens=full)
            self.result.exact = self.result.exact and self.by_name[source].lossless
            self.result.chunks.append(
                ChunkReport(
                    i + k,
                    chunk.tokens,
                    "store",
                    source,
                    bytes=len(f.data),
                    fetch_ms=_ms(f.arrived - f.issued),
                    decode_ms=_ms(share),
                    idle_ms=_ms(idle) if k == 0 else 0.0,
                    gate_ms=_ms(gate) if k == 0 else 0.0,
                )
            )


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
