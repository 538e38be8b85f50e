"""Load test: concurrent streaming chat clients against a gateway, bounded in count and time.

Every client asks a question about one of a few pre-encoded contexts (so the
stored-KV path is under load), streams the answer, and records TTFT, total
latency and the status. 429s are expected once ``--concurrency`` exceeds the
gateway's queue and are counted, not retried. Without ``--url`` it starts its
own gateway on a temporary local store.

    python benchmarks/load_test.py --concurrency 4 --requests 24 --out benchmarks/results/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gateway_bench import MODEL, percentile, real_text  # noqa: E402
from tests.gateway_process import GatewayProcess  # noqa: E402


def require_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
        raise SystemExit(f"refusing to load-test {url}: only loopback targets are allowed")


async def one_request(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    started = time.perf_counter()
    first = None
    cached = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "latency_s": time.perf_counter() - started}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "kv_cache_info" in chunk:
                cached = chunk["kv_cache_info"]["cached_tokens"]
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
    return {"status": 200, "ttft_s": first, "latency_s": time.perf_counter() - started, "cached_tokens": cached}


async def run(url: str, contexts: list[str], args: argparse.Namespace) -> list[dict]:
    questions = ["What is this about?", "Summarize it.", "Name one detail.", "Who is mentioned?"]
    jobs = asyncio.Queue()
    for i in range(args.requests):
        ctx = contexts[i % len(contexts)]
        jobs.put_nowait([{"role": "system", "content": ctx}, {"role": "user", "content": questions[i % 4]}])
    results: list[dict] = []
    deadline = time.monotonic() + args.max_seconds

    async def client_loop() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            while not jobs.empty() and time.monotonic() < deadline:
                results.append(await one_request(client, url, jobs.get_nowait(), args.max_tokens))

    await asyncio.gather(*(client_loop() for _ in range(args.concurrency)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running gateway (loopback only); default: start one")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-seconds", type=float, default=600, help="stop issuing requests after this")
    parser.add_argument("--contexts", type=int, default=2)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.loading import convert_default_model, default_cache_dir

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
    base = real_text(tokenizer, args.context_tokens * args.contexts)
    ids = tokenizer(base)["input_ids"]
    step = len(ids) // args.contexts
    contexts = [tokenizer.decode(ids[i * step : (i + 1) * step]) for i in range(args.contexts)]

    with tempfile.TemporaryDirectory() as tmp:
        gateway = None
        url = args.url
        if url is None:
            gateway = GatewayProcess({"CACHEGEN_STORE": f"file://{tmp}/store"}, Path(tmp) / "gateway.log").start()
            url = gateway.url
        require_loopback(url)
        try:
            for ctx in contexts:
                body = {"messages": [{"role": "system", "content": ctx}], "levels": ["lossless"]}
                httpx.post(f"{url}/contexts", json=body, timeout=900).raise_for_status()
            started = time.perf_counter()
            results = asyncio.run(run(url, contexts, args))
            wall = time.perf_counter() - started
        finally:
            if gateway is not None:
                gateway.stop()

    ok = [r for r in results if r["status"] == 200]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    lat = [r["latency_s"] for r in ok]
    summary = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "wall_s": wall,
        "statuses": dict(Counter(r["status"] for r in results)),
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "output_tokens_per_s": len(ok) * args.max_tokens / wall if wall else 0.0,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "latency_p50_s": percentile(lat, 50) if lat else None,
        "latency_p99_s": percentile(lat, 99) if lat else None,
        "mean_cached_tokens": sum(r["cached_tokens"] for r in ok) / len(ok) if ok else 0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "results": results}, indent=2))
    for key, value in summary.items():
        print(f"{key:>20}: {value:.3f}" if isinstance(value, float) else f"{key:>20}: {value}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
