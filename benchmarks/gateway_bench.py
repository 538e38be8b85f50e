"""Issue-2 benchmark: TTFT with and without lossless KV reuse, and the gateway's own overhead.

Starts the gateway as a real process on a fresh local store, pre-encodes real
contexts of ~2K and ~4K tokens, then measures in the same run:

* TTFT (first streamed content token, client clock) for a question after the
  context: ``kv_cache: false`` (full prefill) vs ``kv_quality: lossless``;
* a short prompt through HTTP vs. the model runner called directly in this
  process (prefill + one token), p50 / p99.

Writes JSON (``--out``) and prints a table.

    python -m benchmarks.gateway_bench --out benchmarks/results/gateway.json

``--auth`` measures instead what API keys and salted chunk keys add: the same
short prompt to two gateways, one open and one with keys (each request sends
its key and a ``cache_salt``), interleaved; and, in this process, the cost of
checking a key and deriving the salted chunk keys of a 4K-token prompt.

    python -m benchmarks.gateway_bench --auth --out benchmarks/results/gateway_auth.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.stats import percentile
from tests.gateway_process import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"
_DOC_MODULES = [
    "argparse",
    "asyncio",
    "collections",
    "concurrent.futures",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "http.client",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "re",
    "sqlite3",
    "string",
    "subprocess",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "zipfile",
    "difflib",
    "heapq",
    "inspect",
    "shutil",
    "tarfile",
    "textwrap",
    "xml.dom",
]


def real_text(tokenizer, tokens: int) -> str:
    """Real English prose: the Python standard library's module and class documentation."""
    import importlib

    parts: list[str] = []
    for name in _DOC_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for _, obj in sorted(vars(module).items()):
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and obj.__doc__:
                parts.append(inspect.getdoc(obj) or "")
        text = "\n\n".join(p for p in parts if p)
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= tokens:
            return tokenizer.decode(ids[:tokens])
    raise RuntimeError("not enough documentation text")


def ttft(url: str, messages: list[dict], extra: dict) -> tuple[float, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True, **extra}
    started = time.perf_counter()
    first: float | None = None
    info: dict = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            info = chunk.get("kv_cache_info", info)
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
    assert first is not None, "no content streamed"
    return first, info


def bench_ttft(url: str, tokenizer, sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for size in sizes:
        context = real_text(tokenizer, size)
        enc = httpx.post(
            f"{url}/contexts", json={"messages": [{"role": "system", "content": context}]}, timeout=900
        )
        enc.raise_for_status()
        created = enc.json()
        messages = [
            {"role": "system", "content": context},
            {"role": "user", "content": "Summarize the text."},
        ]
        ttft(url, messages, {"kv_cache": False})  # warm-up
        cold = [ttft(url, messages, {"kv_cache": False})[0] for _ in range(repeats)]
        warm_runs = [ttft(url, messages, {"kv_quality": "lossless"}) for _ in range(repeats)]
        warm = [t for t, _ in warm_runs]
        info = warm_runs[-1][1]
        rows.append(
            {
                "context_tokens": created["tokens"],
                "cached_tokens": info.get("cached_tokens"),
                "stored_bytes_lossless": created["bytes"]["lossless"],
                "encode_seconds": created["encode_seconds"],
                "ttft_no_reuse_s": statistics.median(cold),
                "ttft_lossless_reuse_s": statistics.median(warm),
                "speedup": statistics.median(cold) / statistics.median(warm),
                "load_ms": info.get("load_ms"),
                "prefill_ms_after_reuse": info.get("prefill_ms"),
                "runs_no_reuse_s": cold,
                "runs_lossless_s": warm,
            }
        )
    return rows


def bench_overhead(url: str, requests: int) -> dict:
    from app.settings import Settings
    from app.threads import configure_threads, thread_budget
    from engine import ModelRunner, load_model
    from engine.sampling import SamplingParams

    settings = Settings()  # the same thread settings as the gateway process
    configure_threads(thread_budget(settings.torch_threads, settings.numba_threads), model_thread=True)
    runner = ModelRunner(load_model())
    messages = [{"role": "user", "content": "Hi!"}]
    prompt = runner.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = runner.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0)

    def direct() -> float:
        t0 = time.perf_counter()
        state = runner.prefill(ids)
        next(iter(runner.decode(state, greedy, 1)))
        return time.perf_counter() - t0

    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, "kv_cache": False}
    with httpx.Client(timeout=120) as client:

        def http() -> float:
            t0 = time.perf_counter()
            client.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
            return time.perf_counter() - t0

        for _ in range(5):
            direct(), http()
        # interleaved, so drift in machine load hits both sides alike
        d, h = [], []
        for _ in range(requests):
            d.append(direct())
            h.append(http())
    return {
        "requests": requests,
        "prompt_tokens": len(ids),
        "direct_p50_ms": percentile(d, 50) * 1000,
        "direct_p99_ms": percentile(d, 99) * 1000,
        "http_p50_ms": percentile(h, 50) * 1000,
        "http_p99_ms": percentile(h, 99) * 1000,
        "overhead_p50_ms": (percentile(h, 50) - percentile(d, 50)) * 1000,
        "overhead_p99_ms": (percentile(h, 99) - percentile(d, 99)) * 1000,
    }


def bench_auth(requests: int) -> dict:
    """HTTP p50/p99 of an open gateway and a keyed one, interleaved; the in-process cost of the key check
    and of salting the chunk keys of a 4K-token prompt."""
    from app.auth import ApiKeys
    from scheduler.prefix import chunk_keys, make_fingerprint

    keys = [f"key-{i:03d}" for i in range(100)]  # every key is compared: the cost grows with their number
    api_keys = ApiKeys(keys)
    fp = make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=256)
    ids = list(range(4096))

    def micro(fn, n: int = 2000) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    check_us = micro(lambda: api_keys.tenant("Bearer key-099").key_space("salt"))
    plain_us = micro(lambda: chunk_keys(fp, ids, 256), 500)
    salted_us = micro(lambda: chunk_keys(fp, ids, 256, b"s" * 32), 500)

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    with tempfile.TemporaryDirectory() as tmp:
        open_env = {"CACHEGEN_STORE": f"file://{tmp}/open", "CACHEGEN_LOG_LEVEL": "warning"}
        keyed_env = {
            "CACHEGEN_STORE": f"file://{tmp}/keyed",
            "CACHEGEN_LOG_LEVEL": "warning",
            "CACHEGEN_API_KEY": ",".join(keys),
        }
        with (
            GatewayProcess(open_env, Path(tmp) / "open.log") as plain,
            GatewayProcess(keyed_env, Path(tmp) / "keyed.log") as keyed,
            httpx.Client(timeout=120) as client,
        ):

            def post(url: str, extra: dict, headers: dict) -> float:
                t0 = time.perf_counter()
                client.post(
                    f"{url}/v1/chat/completions", json={**body, **extra}, headers=headers
                ).raise_for_status()
                return time.perf_counter() - t0

            auth = {"Authorization": "Bearer key-099"}
            for _ in range(5):
                post(plain.url, {}, {}), post(keyed.url, {"cache_salt": "salt"}, auth)
            o, k = [], []
            for i in range(requests):  # interleaved, alternating which goes first
                pair = [(o, plain.url, {}, {}), (k, keyed.url, {"cache_salt": "salt"}, auth)]
                for out, url, extra, headers in pair if i % 2 == 0 else reversed(pair):
                    out.append(post(url, extra, headers))
    return {
        "requests": requests,
        "api_keys": len(keys),
        "open_p50_ms": percentile(o, 50) * 1000,
        "open_p99_ms": percentile(o, 99) * 1000,
        "keyed_p50_ms": percentile(k, 50) * 1000,
        "keyed_p99_ms": percentile(k, 99) * 1000,
        "added_p50_ms": (percentile(k, 50) - percentile(o, 50)) * 1000,
        "key_check_and_salt_us": check_us,
        "chunk_keys_4k_unsalted_us": plain_us,
        "chunk_keys_4k_salted_us": salted_us,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--auth", action="store_true", help="measure what API keys and salting add, only")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gateway.json"))
    args = parser.parse_args()
    if args.auth:
        return main_auth(args)

    from transformers import AutoTokenizer

    from engine.loading import convert_default_model, default_cache_dir

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CACHEGEN_STORE": f"file://{tmp}/store", "CACHEGEN_LOG_LEVEL": "warning"}
        with GatewayProcess(env, Path(tmp) / "gateway.log") as gw:
            ttft_rows = bench_ttft(gw.url, tokenizer, args.sizes, args.repeats)
            overhead = bench_overhead(gw.url, args.requests)
    result = {
        "benchmark": "gateway",
        "machine": {"cpus": os.cpu_count(), "torch_threads": __import__("torch").get_num_threads()},
        "ttft": ttft_rows,
        "overhead": overhead,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))

    print(
        f"{'tokens':>7} {'cached':>7} {'no reuse s':>11} {'lossless s':>11} {'speedup':>8} {'load ms':>8} {'MB':>7}"
    )
    for r in ttft_rows:
        print(
            f"{r['context_tokens']:>7} {r['cached_tokens']:>7} {r['ttft_no_reuse_s']:>11.3f} "
            f"{r['ttft_lossless_reuse_s']:>11.3f} {r['speedup']:>7.1f}x {r['load_ms']:>8.1f} "
            f"{r['stored_bytes_lossless'] / 1e6:>7.1f}"
        )
    o = overhead
    print(
        f"\nshort prompt ({o['prompt_tokens']} tokens, {o['requests']} requests): direct p50 {o['direct_p50_ms']:.1f} ms "
        f"p99 {o['direct_p99_ms']:.1f} ms | HTTP p50 {o['http_p50_ms']:.1f} ms p99 {o['http_p99_ms']:.1f} ms | "
        f"overhead p50 {o['overhead_p50_ms']:.1f} ms p99 {o['overhead_p99_ms']:.1f} ms"
    )
    print(f"wrote {args.out}")
    return 0


def main_auth(args: argparse.Namespace) -> int:
    result = {"benchmark": "gateway_auth", "machine": {"cpus": os.cpu_count()}, **bench_auth(args.requests)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    r = result
    print(f"{'gateway':<8} {'p50 ms':>8} {'p99 ms':>8}   ({r['requests']} interleaved requests each)")
    print(f"{'open':<8} {r['open_p50_ms']:>8.2f} {r['open_p99_ms']:>8.2f}")
    print(
        f"{'keyed':<8} {r['keyed_p50_ms']:>8.2f} {r['keyed_p99_ms']:>8.2f}   (key of {r['api_keys']}, cache_salt)"
    )
    print(f"added p50: {r['added_p50_ms']:+.2f} ms")
    print(
        f"in process: key check + key space {r['key_check_and_salt_us']:.1f} us; chunk keys of 4K tokens "
        f"{r['chunk_keys_4k_unsalted_us']:.1f} us unsalted, {r['chunk_keys_4k_salted_us']:.1f} us salted"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
