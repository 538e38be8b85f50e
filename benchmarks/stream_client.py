"""A closed-loop streaming client for ``benchmarks/batching_bench.py``: C clients send chat
completions back to back until a deadline, and each request's TTFT, inter-token gaps and usage are
recorded. (Open-loop load, SLOs and goodput: guidellm or aiperf, on a dataset from
``benchmarks/prefix_dataset.py``; see the README's Benchmarks section.)"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stats import percentile
from benchmarks.workload import RequestSpec

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Load:
    """One measuring point: ``concurrency`` clients, at most ``requests`` issued, none after ``duration``."""

    concurrency: int
    requests: int
    duration: float
    max_tokens: int
    timeout: float = 600.0
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0


@dataclass
class RequestRecord:
    index: int
    context: int | None
    issued_s: float  # since the start of the run
    status: int | None = None  # HTTP status; None: no response (timeout, connection error)
    error: str | None = None
    rejected: bool = False  # 429, or a rate-limit error event in a stream that had already started
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


def distribution(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": sum(values) / len(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def error_counts(records: list[RequestRecord]) -> dict[str, int]:
    """Failures other than rejections, keyed by HTTP status, or else by what went wrong."""
    keys = []
    for r in records:
        if r.ok or r.rejected:
            continue
        keys.append(str(r.status) if r.status not in (None, 200) else (r.error or "error").split(":")[0])
    return dict(Counter(keys))


def summarize(records: list[RequestRecord], planned: int, duration: float, peak: int) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "requests_planned": planned,
        "requests_issued": len(records),
        "requests_completed": len(ok),
        "requests_rejected": sum(r.rejected for r in records),
        "errors": error_counts(records),
        "peak_in_flight": peak,
        "total_prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "total_output_tokens": output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_token_throughput": output / duration if duration else 0.0,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
    }


# ---------------------------------------------------------------- requests


def request_body(spec: RequestSpec, model: str, load: Load) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": spec.messages,
        "max_tokens": load.max_tokens,
        "temperature": load.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if load.ignore_eos:
        body["ignore_eos"] = True
    if load.top_p != 1.0:
        body["top_p"] = load.top_p
    return body


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
    """Fill ``record`` from an SSE stream: content chunk times and usage."""
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
        usage = chunk.get("usage") or usage
        if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            chunk_times.append(time.perf_counter())
    if chunk_times:
        record.ttft_ms = (chunk_times[0] - started) * 1000
        record.itl_ms = [(b - a) * 1000 for a, b in pairwise(chunk_times)]
    record.output_tokens = len(chunk_times)
    if usage is not None:
        record.output_tokens = usage.get("completion_tokens", record.output_tokens)
        record.prompt_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def run_load(
    client: httpx.AsyncClient, specs: list[RequestSpec], model: str, load: Load
) -> tuple[list[RequestRecord], float, int]:
    """``load.concurrency`` clients through ``specs`` in order; returns the records, the run's
    duration and the peak in flight."""
    slots = asyncio.Semaphore(load.concurrency)
    in_flight = peak = 0
    t0 = time.perf_counter()
    deadline = t0 + load.duration

    async def issue(spec: RequestSpec) -> RequestRecord | None:
        nonlocal in_flight, peak
        async with slots:
            if time.perf_counter() >= deadline:
                return None  # waited for a slot past the end of the run: never issued
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(client, spec, request_body(spec, model, load), t0, load.timeout)
            finally:
                in_flight -= 1

    tasks = [asyncio.create_task(issue(spec)) for spec in specs[: load.requests]]
    records = [r for r in await asyncio.gather(*tasks) if r is not None]
    return records, time.perf_counter() - t0, peak


# ---------------------------------------------------------------- the gateway under test


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
