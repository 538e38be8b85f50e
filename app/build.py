"""How a gateway is assembled at start-up: threads, model, identity, store, codec, cost profile.

``build_gateway`` makes the long-lived parts once (``create_app``, the encode
CLI and the image's build step call it) and logs each stage with its time.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from app.admission import Admission
from app.gateway import Gateway, load_levels, pick_levels
from app.malloc_trim import trim_now
from app.metrics import Metrics
from app.settings import Settings
from app.threads import codec_threads, configure_threads, thread_budget, worker_initializer
from codec import Level, level_transforms
from engine import ModelRunner, load_model
from engine.identity import model_identity
from scheduler.codec_gate import CodecGate
from scheduler.contexts import ContextStore
from scheduler.executor import RequestExecutor, RequestState
from scheduler.geometry import KVGeometry
from scheduler.kv_memory import KVMemory
from scheduler.lifecycle import StoreCollector
from scheduler.loader import PrefixLoader
from scheduler.prefix import chain_root, make_fingerprint
from scheduler.prefix_cache import PrefixCache
from scheduler.profile import load_or_measure, profile_key, profile_path
from scheduler.step_loop import StepLoop
from scheduler.store_levels import default_store_levels
from scheduler.write_back import WriteBack
from storage import open_store

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def warm_up_codec(levels: tuple[Level, ...], geometry: KVGeometry, chunk_size: int) -> None:
    """Encode and decode a whole chunk at every level, as a context's first chunk and as a later
    one, so that the one-time costs happen at start-up, not in the first request: numba's compile
    (or cache load), and the inverse transform's buffers at a whole chunk's size (``codec.transform``
    reuses them; a 16-token warm-up left a fresh gateway's first 256-token inverse at 113 ms,
    against 10 ms after it, most of it faulting fresh memory in)."""
    import torch

    from codec import decode_chunk, encode_chunk

    sample = torch.randn(geometry.chunk_shape(chunk_size), generator=torch.Generator().manual_seed(0))
    for level in levels:
        for position in (0, chunk_size):  # the first chunk keeps its first tokens exact
            decode_chunk(encode_chunk(sample, level, position=position))


def warm_up_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Render the chat template once: jinja compiles it on first use, 9 ms here, which a fresh
    gateway's first chat would pay."""
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template that refuses this refuses requests alike, with a 400
        log.debug("the chat template refused the warm-up conversation", exc_info=True)


@contextlib.contextmanager
def _stage(what: str) -> Iterator[None]:
    """Log a start-up stage as it starts and with its time when done: start-up takes seconds (the
    model, its content digest, the codec's compile, the cost profile) and should say so."""
    log.info("start-up: %s ...", what)
    started = time.perf_counter()
    yield
    log.info("start-up: %s done in %.1f s", what, time.perf_counter() - started)


def build_gateway(settings: Settings, metrics: Metrics | None = None) -> Gateway:
    threads = thread_budget(settings.torch_threads, settings.numba_threads)
    configure_threads(threads, codec_layer=settings.codec_threading_layer)
    with _stage(f"loading the model {settings.model or 'default'}"):
        loaded = load_model(
            settings.model,
            device=settings.device,
            cache_dir=settings.cache_dir,
            served_name=settings.served_model_name,
            dtype=settings.dtype,
        )
    runner = ModelRunner(loaded)
    if settings.max_model_len and settings.max_model_len > runner.max_context:
        log.warning(
            "max_model_len %d is more than the model's window; using %d",
            settings.max_model_len,
            runner.max_context,
        )
    with _stage("the weights' content digest (cached beside the weights after the first time)"):
        identity = model_identity(
            loaded.model,
            loaded.tokenizer.get_vocab(),
            loaded.weights_dir,
            settings.cache_dir,
            precision=loaded.precision,
        )
    # the gateway only runs the engine's fused forward where there is one: the model's own copies
    # of those weights go (after the digest, which reads them)
    released = runner.release_transformers_weights()
    if released:
        log.info(
            "start-up: gave back %d MiB of plain projection weights (engine.fused_layers); RSS -%d MiB",
            released >> 20,
            trim_now() >> 20,  # what the copies out of the weight file's mapping left in the arenas
        )
    fingerprint = make_fingerprint(
        weights=identity.weights,
        config=identity.config,
        dtype=identity.dtype,
        vocabulary=identity.vocabulary,
        chunk_size=settings.chunk_size,
    )
    with _stage(
        f"the KV pool ({settings.kv_memory_bytes >> 20} MiB on a CPU, prefault {settings.kv_prefault})"
    ):
        runner.use_kv_pool(settings.kv_memory_bytes, settings.kv_prefault)
    with _stage(f"opening the KV store {settings.store_url}"):
        store = open_store(settings.store_url, cache_bytes=settings.store_cache_size)
    # every thread but the model thread runs torch on one thread (app/threads.py)
    worker_threads = worker_initializer(threads)
    io_pool = ThreadPoolExecutor(
        max_workers=settings.store_threads, thread_name_prefix="kv-io", initializer=worker_threads
    )
    # one codec operation at a time, on the budget's numba threads: decodes of concurrent loads and
    # encodes of pre-encodes and write-backs would otherwise oversubscribe the cores
    codec_gate = CodecGate()
    loop = StepLoop(
        runner,
        settings.max_num_seqs,
        max_batched_tokens(settings, runner),
        torch_threads=lambda: threads.torch if codec_gate.active else threads.torch_alone,
    )
    codec_gate.interactive = loop.interactive_work  # encodes yield to generations (scheduler/codec_gate.py)
    codec_gate.before = codec_threads(threads, loop.model_busy)  # every core while the model idles
    contexts = ContextStore(
        store, fingerprint, loaded.name, settings.chunk_size, io_pool, codec_gate.background()
    )
    geometry = KVGeometry(runner.num_layers, runner.num_kv_heads, runner.head_dim)
    metrics = metrics or Metrics()
    table = load_levels(settings, runner.device.type, geometry)
    levels = table.levels
    with _stage("compiling the codec and the decode kernel (numba's cache makes it quick)"):
        warm_up_codec(levels, geometry, settings.chunk_size)
        runner.warm_up()
        warm_up_chat_template(runner.tokenizer)
    profile_file = profile_path(
        settings.cache_dir, profile_key(fingerprint.hex, runner, list(levels), settings.chunk_size)
    )
    # measured on the model thread, at the speed requests will see
    with _stage(f"the cost profile ({'cached' if profile_file.exists() else 'measuring this machine'})"):
        profile = loop.call(load_or_measure, profile_file, runner, list(levels), settings.chunk_size)
    if settings.hold_for_loads:
        loop.prefill_seconds = profile.prefill_seconds  # a burst's questions share a step
    transforms = level_transforms(levels)
    for transform in transforms.values():
        if transform.model != identity.weights:
            log.warning(
                "the level table's transform %s was calibrated on other weights (%s): chunks still "
                "decode exactly, but may code worse; python -m app calibrate --transform fits this model",
                transform.id.hex(),
                transform.model[:16] or "unknown",
            )
    loader = PrefixLoader(
        store,
        geometry,
        io_pool,
        profile,
        codec_gate=codec_gate,
        transforms=transforms,
        staging=runner.kv_pool.buffer if runner.kv_pool is not None else None,
        chunk_size=settings.chunk_size,
    )
    store_levels = default_store_levels(levels, profile, settings.chunk_size, runner.kv_bytes_per_token)
    log.info(
        "levels stored by default: %s (lossless %s: a raw chunk over 1 Gbit/s against its recompute)",
        ", ".join(lv.name for lv in store_levels),
        "pays" if any(lv.lossless for lv in store_levels) else "does not pay",
    )
    write_back = None
    if settings.write_back:
        write_back = WriteBack(
            contexts,
            pick_levels(levels, settings.write_back_levels) if settings.write_back_levels else store_levels,
            on_done=lambda outcome: metrics.write_backs.labels(outcome).inc(),
            initializer=worker_threads,
        )
    cache = PrefixCache(lambda space: chain_root(fingerprint, space.salt)) if settings.prefix_cache else None
    memory = KVMemory(settings.kv_memory_bytes, reclaim=cache.reclaim if cache is not None else None)
    admission = Admission(
        settings.max_queue,
        worker_threads,
        encode_threads=settings.encode_threads,
        max_encodes_per_tenant=settings.max_encodes_per_tenant,
    )
    metrics.running.set_function(lambda: loop.running)
    metrics.waiting.set_function(lambda: max(0, admission.admitted - loop.running))
    prepare = ThreadPoolExecutor(
        max_workers=max(2, min(8, settings.max_num_seqs)),
        thread_name_prefix="prepare",
        initializer=worker_threads,
    )
    executor = RequestExecutor(runner, contexts, loader, loop, memory, prepare, write_back, cache)
    for state in (RequestState.WAITING, RequestState.LOADING, RequestState.RUNNING):
        metrics.request_states.labels(state.value).set_function(lambda state=state: executor.count(state))
    metrics.kv_memory_used.set_function(lambda: memory.used)
    metrics.engine_steps.set_function(lambda: loop.stats.steps)
    metrics.engine_busy.set_function(lambda: loop.stats.busy_s)
    metrics.engine_held.set_function(lambda: loop.stats.held_s)
    metrics.engine_decode_tokens.set_function(lambda: loop.stats.decode_tokens)
    metrics.engine_prefill_tokens.set_function(lambda: loop.stats.prefill_tokens)
    metrics.kv_memory_budget.set(settings.kv_memory_bytes)
    if runner.kv_pool is not None:
        pool = runner.kv_pool
        metrics.kv_pool_used.set_function(lambda: pool.used_bytes)
        metrics.kv_pool_misses.set_function(lambda: pool.misses)
    metrics.replica.labels(settings.replica).set(1)
    if cache is not None:
        metrics.memory_prefix_bytes.set_function(lambda: cache.cached_bytes)
        metrics.memory_prefix_evictions.set_function(lambda: cache.stats.evicted_runs)
        metrics.memory_prefix_copied.set_function(lambda: cache.stats.copied_tokens)
    log.info(
        "serving %s on %s (%s), KV store %s, fingerprint %s; threads: torch %d (%d alone), codec %d (%d alone)",
        loaded.name,
        loaded.device,
        loaded.precision,
        store,
        fingerprint.hex[:16],
        threads.torch,
        threads.torch_alone,
        threads.numba,
        threads.numba_alone,
    )
    return Gateway(
        settings=settings,
        runner=runner,
        store=store,
        contexts=contexts,
        executor=executor,
        admission=admission,
        loop=loop,
        memory=memory,
        metrics=metrics,
        table=table,
        profile_file=profile_file,
        io_pool=io_pool,
        collector=StoreCollector(store, settings.gc_grace_s, settings.store_max_bytes),
        store_levels=tuple(store_levels),
    )


def max_batched_tokens(settings: Settings, runner: ModelRunner) -> int:
    """The step's token budget. On 2 CPU cores each prefill token adds about 1.6 ms to a step that
    decodes 4 streams in about 55 ms: 64 keeps a stream's inter-token gap within about 3x while a
    context is pre-encoded (``docs/serving.md``). A GPU step costs about the same up to thousands."""
    if settings.max_batched_tokens is not None:
        return settings.max_batched_tokens
    return 2048 if runner.device.type == "cuda" else 64
