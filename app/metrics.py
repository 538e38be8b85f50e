"""Prometheus metrics, named after vLLM's (``cachegen:`` instead of ``vllm:``).

One registry per app instance, so tests can run several apps in a process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "cachegen:time_to_first_token_seconds", "Time to first token.", registry=r, buckets=_TTFT_BUCKETS
        )
        self.e2e_latency = Histogram(
            "cachegen:e2e_request_latency_seconds",
            "End-to-end request latency.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.requests = Counter(
            "cachegen:request_success", "Finished requests.", ["endpoint", "finished_reason"], registry=r
        )
        self.http_errors = Counter(
            "cachegen:request_errors",
            "Error responses by status and code (the error object's code, else its type); "
            "status 'stream' for an error sent inside a streamed response.",
            ["status", "code"],
            registry=r,
        )
        self.prompt_tokens = Counter("cachegen:prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("cachegen:generation_tokens", "Generated tokens.", registry=r)
        self.prefix_queries = Counter(
            "cachegen:prefix_cache_queries", "Prompt tokens looked up in the KV store.", registry=r
        )
        self.prefix_hits = Counter(
            "cachegen:prefix_cache_hits", "Prompt tokens whose KV came from the store.", registry=r
        )
        self.memory_prefix_hits = Counter(
            "cachegen:memory_prefix_cache_hits",
            "Prompt tokens whose KV came from memory (the prefix cache of computed KV).",
            registry=r,
        )
        self.memory_prefix_copied = Gauge(
            "cachegen:memory_prefix_cache_copied_tokens",
            "Of the memory hits, tokens copied into a request's buffer instead of attached.",
            registry=r,
        )
        self.memory_prefix_bytes = Gauge(
            "cachegen:memory_prefix_cache_bytes",
            "KV memory held by the prefix cache (finished requests' buffers; evicted when needed).",
            registry=r,
        )
        self.memory_prefix_evictions = Gauge(
            "cachegen:memory_prefix_cache_evicted_runs", "Cached buffers evicted so far.", registry=r
        )
        self.kv_bytes_loaded = Counter(
            "cachegen:kv_bytes_loaded", "Encoded KV bytes fetched from the store.", ["level"], registry=r
        )
        self.kv_load_seconds = Histogram(
            "cachegen:kv_load_seconds",
            "Fetch and decode time of a prefix.",
            registry=r,
            buckets=_TTFT_BUCKETS,
        )
        self.replica = Gauge(
            "cachegen:replica_info",
            "1, labelled with this gateway's name (the replica setting).",
            ["replica"],
            registry=r,
        )
        self.kv_store_faults = Counter(
            "cachegen:kv_store_faults", "Stored KV that could not be used (recomputed).", ["kind"], registry=r
        )
        self.write_backs = Counter(
            "cachegen:kv_write_backs",
            "Background stores of a request's uncached chunks.",
            ["outcome"],
            registry=r,
        )
        self.kv_chunks = Counter(
            "cachegen:kv_chunks",
            "Prefix chunks loaded, by source: a level name, or 'text' (recomputed).",
            ["source"],
            registry=r,
        )
        self.kv_chunks_recomputed = Counter(
            "cachegen:kv_chunks_recomputed", "Stored chunks the planner recomputed from text.", registry=r
        )
        self.kv_chunk_seconds = Histogram(
            "cachegen:kv_chunk_seconds",
            "Per-chunk time of each loading stage (fetch, decode, prefill of text chunks).",
            ["stage"],
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.kv_slo = Counter(
            "cachegen:kv_slo",
            "Requests with a kv_slo_ms budget, by whether load + prefill met it.",
            ["outcome"],
            registry=r,
        )
        self.kv_bandwidth = Gauge(
            "cachegen:kv_bandwidth_estimate_bytes_per_second",
            "The store link's bandwidth, as measured from chunk fetches.",
            registry=r,
        )
        self.contexts_encoded = Counter("cachegen:contexts_encoded", "Contexts pre-encoded.", registry=r)
        self.contexts_cancelled = Counter(
            "cachegen:contexts_encode_cancelled", "Pre-encodes stopped because their client left.", registry=r
        )
        self.running = Gauge("cachegen:num_requests_running", "Requests on the model.", registry=r)
        self.kv_memory_used = Gauge(
            "cachegen:kv_memory_used_bytes",
            "KV memory reserved by requests in flight and by the prefix cache.",
            registry=r,
        )
        self.kv_memory_budget = Gauge(
            "cachegen:kv_memory_budget_bytes", "The KV memory budget (CACHEGEN_KV_MEMORY_BYTES).", registry=r
        )
        self.kv_pool_used = Gauge(
            "cachegen:kv_pool_used_bytes",
            "KV pool blocks held by live buffers (engine/kv_pool.py; freed with the buffer's last reader).",
            registry=r,
        )
        self.kv_pool_misses = Gauge(
            "cachegen:kv_pool_misses",
            "KV buffers allocated outside the pool: no run of free blocks was long enough.",
            registry=r,
        )
        self.waiting = Gauge("cachegen:num_requests_waiting", "Requests queued for the model.", registry=r)
        self.request_states = Gauge(
            "cachegen:requests_by_state",
            "Generations by scheduler state (scheduler/executor.py RequestState): waiting for KV memory "
            "or a sibling's prompt, loading their prefix, or running on the step loop.",
            ["state"],
            registry=r,
        )
        # the step loop's own counts (scheduler/step_loop.py StepStats): mean batch and step time
        self.engine_steps = Gauge("cachegen:engine_steps", "Model steps run.", registry=r)
        self.engine_busy = Gauge(
            "cachegen:engine_busy_seconds", "Seconds the model thread spent in forward passes.", registry=r
        )
        self.engine_held = Gauge(
            "cachegen:engine_held_seconds",
            "Seconds the model thread held a step of new prompts for prefix loads in flight.",
            registry=r,
        )
        self.engine_decode_tokens = Gauge(
            "cachegen:engine_decode_tokens", "Decode tokens the model steps ran.", registry=r
        )
        self.engine_prefill_tokens = Gauge(
            "cachegen:engine_prefill_tokens", "Prefill tokens the model steps ran.", registry=r
        )
        # the C allocator's trim (app/malloc_trim.py)
        self.malloc_trims = Counter(
            "cachegen:malloc_trims", "malloc_trim calls: free arena pages given back to the OS.", registry=r
        )
        self.malloc_trim_released = Counter(
            "cachegen:malloc_trim_released_bytes", "Bytes the RSS fell by in malloc_trim calls.", registry=r
        )
        self.malloc_trim_seconds = Counter(
            "cachegen:malloc_trim_seconds", "Seconds spent in malloc_trim calls.", registry=r
        )
        # the store's lifecycle (scheduler/lifecycle.py): garbage collection and the size cap
        self.store_bytes = Gauge(
            "cachegen:store_bytes", "Bytes in the KV store, as of the last collection.", registry=r
        )
        self.collections = Counter(
            "cachegen:store_collections",
            "Collection passes this gateway ran (a periodic sweep another replica's lease holds is not one).",
            registry=r,
        )
        self.contexts_expired = Counter(
            "cachegen:contexts_expired", "Expired contexts deleted by the collector.", registry=r
        )
        self.gc_objects = Counter(
            "cachegen:gc_deleted_objects",
            "Objects of unreferenced chunks deleted by the collector.",
            registry=r,
        )
        self.contexts_evicted = Counter(
            "cachegen:store_evicted_contexts", "Contexts evicted to keep the store under its cap.", registry=r
        )
        self.evicted_bytes = Counter(
            "cachegen:store_evicted_bytes", "Bytes freed by evicting contexts.", registry=r
        )

    def record_malloc_trim(self, released_bytes: int, seconds: float) -> None:
        self.malloc_trims.inc()
        self.malloc_trim_released.inc(released_bytes)
        self.malloc_trim_seconds.inc(seconds)
