"""Load test for any OpenAI-compatible deployment, in the manner of ``vllm bench serve``.

Streams chat completions at a given load shape and reports TTFT, TPOT, ITL and
end-to-end latency (mean, p50, p90, p99), request / token throughput, errors by
status (429s, and rate-limit errors inside a stream, counted apart as rejected)
and SLO attainment. Writes a JSON file (config, summary, one record per
request) and a PNG plot (latency over time and its CDF; needs matplotlib,
skipped with a note when it is missing).

Load shape, as in vllm bench serve:

* ``--request-rate R``: Poisson arrivals at R requests/s (``inf``, the default:
  all at once);
* ``--concurrency C``: at most C requests in flight (with ``inf``: C clients);
* both: arrivals at R/s, never more than C in flight.

Every run is bounded: ``--requests N`` and ``--duration S`` (no request is
issued after S seconds; whichever comes first), and ``--timeout`` per request.

Workload: ``--num-contexts K --context-tokens T`` builds K distinct long
contexts of real prose (or ``--context-file`` files, one context each),
pre-encodes each one with ``POST /contexts`` (unless ``--no-pre-encode``; only
this gateway has that endpoint), then every request is that system message
plus a different user question. ``--short-prompts`` sends short chat prompts
with no context.

    # against a deployment
    python -m benchmarks.load_test --url http://host:8000 --num-contexts 4 --context-tokens 4096 \\
        --request-rate 2 --concurrency 8 --requests 200 --duration 300 --max-tokens 128 --ignore-eos \\
        --slo-ttft-ms 500 --api-key "$KEY"
    # without --url: starts its own gateway (default model, temporary local store)
    python -m benchmarks.load_test --short-prompts --concurrency 2 --requests 16 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from benchmarks.load_report import RequestRecord, print_table, summarize, write_plot

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUESTIONS = (
    "What does the text say about {}?",
    "Explain the role of {} in the text.",
    "Summarize what the text tells us about {}.",
    "Give one detail the text mentions about {}.",
    "How is {} used, according to the text?",
    "Quote the sentence that mentions {}.",
)
SHORT_PROMPTS = (
    "Write one sentence about {}.",
    "Give a short definition of {}.",
    "Name three facts about {}.",
    "Describe {} to a child.",
)
TOPICS = (
    "rivers", "volcanoes", "bees", "the moon", "bridges", "tea", "glaciers", "owls", "compilers",
    "bicycles", "lighthouses", "coral reefs", "chess", "bread", "comets", "violins", "deserts",
    "maps", "clocks", "whales", "windmills", "paper", "salt", "thunderstorms",
)  # fmt: skip


@dataclass
class RequestSpec:
    index: int
    messages: list[dict[str, str]]
    context: int | None


# ---------------------------------------------------------------- workload


def load_tokenizer(name: str) -> Any:
    """A tokenizer to size the contexts: the built-in model's, a HF one, or ~4 characters a token."""
    if name == "chars":
        return CharTokenizer()
    try:
        from transformers import AutoTokenizer

        if name == "default":
            from engine.loading import convert_default_model, default_cache_dir

            return AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - sizing is approximate anyway; say so and go on
        print(f"note: tokenizer {name!r} unavailable ({exc}); sizing contexts at ~4 characters a token")
        return CharTokenizer()


class CharTokenizer:
    """Duck-types the two tokenizer calls ``real_text`` makes, at 4 characters a token."""

    def __call__(self, text: str) -> dict[str, list[str]]:
        return {"input_ids": [text[i : i + 4] for i in range(0, len(text), 4)]}

    def decode(self, ids: list[str]) -> str:
        return "".join(ids)


def build_contexts(tokenizer: Any, count: int, tokens: int) -> list[str]:
    """``count`` distinct contexts of ``tokens`` tokens each: slices of one real-prose corpus.

    The corpus holds about 20K tokens; slices wrap around it, and each context
    opens with its own title so no two share a stored leading chunk.
    """
    from benchmarks.gateway_bench import real_text

    corpus = tokenizer(real_text(tokenizer, min(count * tokens, 20_000)))["input_ids"]
    contexts = []
    for k in range(count):
        start = (k * tokens) % len(corpus)
        ids = [corpus[(start + i) % len(corpus)] for i in range(tokens)]
        contexts.append(f"Document {k + 1} of {count}.\n\n{tokenizer.decode(ids)}")
    return contexts


def keywords(text: str, limit: int = 64) -> list[str]:
    """Distinct long words of a context, in order: what the questions ask about."""
    seen: dict[str, None] = {}
    for word in text.split():
        word = word.strip(".,;:()[]{}'\"`*")
        if len(word) >= 7 and word.isalpha():
            seen.setdefault(word.lower(), None)
        if len(seen) >= limit:
            break
    return list(seen) or list(TOPICS)


def build_requests(contexts: list[str], count: int, seed: int) -> list[RequestSpec]:
    """Round-robin over the contexts; each request asks a different question (or a short prompt)."""
    rng = random.Random(seed)
    specs = []
    words = [keywords(c) for c in contexts]
    for i in range(count):
        if not contexts:
            prompt = SHORT_PROMPTS[i % len(SHORT_PROMPTS)].format(rng.choice(TOPICS))
            specs.append(RequestSpec(i, [{"role": "user", "content": f"{prompt} (#{i})"}], None))
            continue
        k = i % len(contexts)
        question = QUESTIONS[rng.randrange(len(QUESTIONS))].format(rng.choice(words[k]))
        messages = [{"role": "system", "content": contexts[k]}, {"role": "user", "content": question}]
        specs.append(RequestSpec(i, messages, k))
    return specs


def request_body(spec: RequestSpec, model: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": spec.messages,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # extension fields only when asked for: other servers may reject unknown ones
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.kv_quality is not None:
        body["kv_quality"] = args.kv_quality
    if args.kv_slo_ms is not None:
        body["kv_slo_ms"] = args.kv_slo_ms
    if args.no_kv_cache:
        body["kv_cache"] = False
    return body


# ---------------------------------------------------------------- one request


async def send_request(
    client: httpx.AsyncClient, spec: RequestSpec, body: dict[str, Any], t0: float, timeout: float
) -> RequestRecord:
    """Stream one chat completion; any failure becomes part of the record, never an exception."""
    record = RequestRecord(spec.index, spec.context, time.perf_counter() - t0)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                record.status = response.status_code
                record.rejected = response.status_code == 429
                if response.status_code != 200:
                    record.error = (await response.aread()).decode(errors="replace")[:300]
                    return record
                await read_stream(response, record, started)
    except TimeoutError:
        record.error = "timeout"
    except httpx.HTTPError as exc:
        record.error = type(exc).__name__
    except (ValueError, AttributeError) as exc:  # not JSON, or not shaped like a chunk
        record.error = f"invalid stream: {exc}"[:300]
    record.e2e_ms = (time.perf_counter() - started) * 1000
    if record.ttft_ms is not None and record.output_tokens > 1:
        record.tpot_ms = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)
    return record


async def read_stream(response: httpx.Response, record: RequestRecord, started: float) -> None:
    """Fill ``record`` from an SSE stream: content chunk times, usage, ``kv_cache_info``."""
    chunk_times: list[float] = []
    usage: dict[str, Any] | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": chunk["error"]}
            record.error = f"stream error: {error.get('message')}"[:300]
            record.rejected = error.get("code") == "rate_limit_exceeded"
            break
        if record.kv_cache_info is None and isinstance(chunk.get("kv_cache_info"), dict):
            info = chunk["kv_cache_info"]
            record.kv_cache_info = {**info, "chunks": len(info.get("chunks") or [])}
        usage = chunk.get("usage") or usage
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            chunk_times.append(time.perf_counter())
    if chunk_times:
        record.ttft_ms = (chunk_times[0] - started) * 1000
        record.itl_ms = [(b - a) * 1000 for a, b in pairwise(chunk_times)]
    record.output_tokens = len(chunk_times)
    record.output_tokens_from = "chunks"
    if usage is not None:
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        record.output_tokens_from = "usage"
        record.prompt_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


# ---------------------------------------------------------------- load shape


def arrival_gaps(count: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before issuing each request: Poisson arrivals, or none at rate ``inf``."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]


async def run_load(
    client: httpx.AsyncClient, specs: list[RequestSpec], model: str, args: argparse.Namespace
) -> tuple[list[RequestRecord], float, int]:
    """Issue ``specs`` at the load shape; returns the records, the run's duration and peak in-flight."""
    limit = asyncio.Semaphore(args.concurrency) if args.concurrency else None
    in_flight = peak = 0
    t0 = time.perf_counter()
    deadline = t0 + args.duration

    async def issue(spec: RequestSpec) -> RequestRecord | None:
        nonlocal in_flight, peak
        async with limit if limit is not None else nullcontext():
            if time.perf_counter() >= deadline:
                return None  # waited for a slot past the end of the run: never issued
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(client, spec, request_body(spec, model, args), t0, args.timeout)
            finally:
                in_flight -= 1

    tasks = []
    for spec, gap in zip(specs, arrival_gaps(len(specs), args.request_rate, args.seed)):
        if gap:
            await asyncio.sleep(min(gap, max(0.0, deadline - time.perf_counter())))
        if time.perf_counter() >= deadline:
            break
        tasks.append(asyncio.create_task(issue(spec)))
    records = [r for r in await asyncio.gather(*tasks) if r is not None]
    return records, time.perf_counter() - t0, peak


def config_record(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "out", "plot")}
    config.update(url=url, model=model, api_key="set" if args.api_key else None)
    config["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    config["context_file"] = [str(p) for p in args.context_file or []]
    return config


# ---------------------------------------------------------------- setup


@dataclass
class Target:
    url: str
    pid: int | None = None  # the gateway this tool started, if it did

    def peak_rss_bytes(self) -> int | None:
        """The started gateway's peak resident memory so far (Linux ``VmHWM``)."""
        if self.pid is None:
            return None
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return None
        line = next((ln for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
        return None if line is None else int(line.split()[1]) * 1024


@contextmanager
def target(url: str | None, gateway_env: list[str]) -> Iterator[Target]:
    """The given URL, or a gateway of our own on a temporary local store for the duration."""
    if url is not None:
        yield Target(url.rstrip("/"))
        return
    from tests.gateway_process import GatewayProcess

    with tempfile.TemporaryDirectory() as tmp:
        print("starting a gateway on a temporary local store ...")
        env = {"CACHEGEN_STORE": f"file://{tmp}/store"}
        env.update(item.split("=", 1) for item in gateway_env)
        with GatewayProcess(env, Path(tmp) / "gateway.log") as gateway:
            assert gateway.proc is not None
            yield Target(gateway.url, gateway.proc.pid)


def served_model(client: httpx.Client) -> str:
    response = client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def pre_encode(client: httpx.Client, contexts: list[str], levels: list[str] | None) -> list[dict[str, Any]]:
    """``POST /contexts`` for each context, so requests find their KV stored."""
    created = []
    for k, text in enumerate(contexts):
        body: dict[str, Any] = {"messages": [{"role": "system", "content": text}]}
        if levels:
            body["levels"] = levels
        response = client.post("/contexts", json=body)
        if response.status_code != 200:
            raise SystemExit(
                f"POST /contexts failed ({response.status_code}): {response.text[:300]}\n"
                "(a server without this gateway's /contexts endpoint needs --no-pre-encode)"
            )
        info = response.json()
        keys = ("id", "tokens", "cached_tokens", "chunks", "bytes", "encode_seconds")
        created.append({"context": k, **{key: info.get(key) for key in keys}})
        print(
            f"pre-encoded context {k}: {info.get('tokens')} tokens in {info.get('encode_seconds', 0):.2f} s"
        )
    return created


def contexts_for(args: argparse.Namespace) -> list[str]:
    if args.short_prompts:
        return []
    if args.context_file:
        return [p.read_text(errors="replace") for p in args.context_file]
    return build_contexts(load_tokenizer(args.tokenizer), args.num_contexts, args.context_tokens)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of the deployment (no /v1); default: start a gateway")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    p.add_argument("--model", help="default: the first model of GET /v1/models")
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="without --url: a setting for the gateway this tool starts (repeatable)")  # fmt: skip
    load = p.add_argument_group("load shape and bounds")
    load.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s; inf: at once")
    load.add_argument("--concurrency", type=int, help="most requests in flight at once")
    load.add_argument("--requests", type=int, default=64, help="requests to issue at most")
    load.add_argument("--duration", type=float, default=600.0, help="issue no request after this (s)")
    load.add_argument("--timeout", type=float, default=300.0, help="per request, whole stream (s)")
    load.add_argument("--seed", type=int, default=0, help="arrivals and question choice")
    work = p.add_argument_group("workload")
    work.add_argument("--short-prompts", action="store_true", help="short chat prompts, no context")
    work.add_argument("--num-contexts", type=int, default=2)
    work.add_argument("--context-tokens", type=int, default=2048)
    work.add_argument("--context-file", type=Path, action="append", help="a context per file (repeatable)")
    work.add_argument("--tokenizer", default="default",
                      help="sizes the contexts: 'default' (built-in model), a HF id or directory, 'chars'")  # fmt: skip
    work.add_argument("--no-pre-encode", action="store_true", help="skip POST /contexts")
    work.add_argument("--encode-levels", help="comma-separated levels to pre-encode; default: the gateway's")
    gen = p.add_argument_group("generation")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--kv-quality", help="extension field kv_quality, e.g. lossless")
    gen.add_argument("--kv-slo-ms", type=float, help="extension field kv_slo_ms")
    gen.add_argument("--no-kv-cache", action="store_true", help="send kv_cache: false (full prefill)")
    out = p.add_argument_group("SLO and outputs")
    out.add_argument("--slo-ttft-ms", type=float, help="SLO attainment: TTFT at most this")
    out.add_argument("--slo-e2e-ms", type=float, help="SLO attainment: end-to-end latency at most this")
    out.add_argument("--out", type=Path, help="JSON; default benchmarks/results/load_<timestamp>.json")
    out.add_argument("--plot", type=Path, help="PNG; default next to the JSON")
    out.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    if args.requests < 1 or args.duration <= 0 or args.timeout <= 0 or args.request_rate <= 0:
        p.error("--requests, --duration, --timeout and --request-rate must be positive")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    contexts = contexts_for(args)
    specs = build_requests(contexts, args.requests, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    out = args.out or RESULTS_DIR / f"load_{datetime.now():%Y%m%d_%H%M%S}.json"
    with target(args.url, args.gateway_env) as started:
        url = started.url
        with httpx.Client(base_url=url, headers=headers, timeout=max(args.timeout, 900.0)) as setup:
            model = args.model or served_model(setup)
            encoded = [] if args.no_pre_encode or not contexts else pre_encode(setup, contexts, _levels(args))
        print(f"{len(specs)} requests to {url} (model {model}) ...")
        records, duration, peak = asyncio.run(_run(url, headers, specs, model, args))
        peak_rss = started.peak_rss_bytes()
    summary = summarize(records, len(specs), duration, peak, args)
    if peak_rss is not None:
        summary["gateway_peak_rss_mib"] = round(peak_rss / 2**20, 1)
        print(f"gateway peak RSS: {summary['gateway_peak_rss_mib']} MiB")
    print_table(summary)
    result = {
        "config": config_record(args, url, model),
        "contexts": encoded,
        "summary": summary,
        "requests": [asdict(r) for r in records],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    plot = args.plot or out.with_suffix(".png")
    if not args.no_plot and write_plot(records, plot):
        print(f"wrote {plot}")
    return 0


def _levels(args: argparse.Namespace) -> list[str] | None:
    return [s.strip() for s in args.encode_levels.split(",")] if args.encode_levels else None


async def _run(
    url: str, headers: dict[str, str], specs: list[RequestSpec], model: str, args: argparse.Namespace
) -> tuple[list[RequestRecord], float, int]:
    pool = args.concurrency or len(specs)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=httpx.Timeout(args.timeout)
    ) as client:
        return await run_load(client, specs, model, args)


if __name__ == "__main__":
    sys.exit(main())
