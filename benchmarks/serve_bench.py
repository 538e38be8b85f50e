"""Issue-4 benchmark: serving a stored ~4K-token context from S3, from the local directory, and by recompute.

Starts a SeaweedFS server and two gateway processes (one on S3, one on a local
directory; both with the in-memory LRU off so every read goes to the store),
pre-encodes the same real context on each, and measures TTFT (first streamed
token, client clock) per source and level in one run. Also times the
scheduler's lookup for a 32-chunk prompt against S3, on a miss and on a hit:
one GET of the prefix index, which lists every stored chunk with its sizes.

    python -m benchmarks.serve_bench --out benchmarks/results/serve.json
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.gateway_bench import percentile, real_text, ttft
from tests.gateway_process import GatewayProcess
from tests.support.seaweed import SeaweedServer


def bench_lookup(server: SeaweedServer, bucket: str, rounds: int) -> dict:
    """Scheduler lookup of a 32-chunk prompt on S3: miss vs hit (chunk 0 present)."""
    import os

    import codec
    from scheduler.contexts import ContextStore
    from scheduler.prefix import make_fingerprint
    from scheduler.stored import find_stored_prefix
    from storage.s3 import S3Store

    os.environ.update(server.env())
    store = S3Store(bucket, "lookup")
    fingerprint = make_fingerprint(weights="bench", config={}, vocabulary="bench", chunk_size=256)
    contexts = ContextStore(store, fingerprint, "bench", 256, ThreadPoolExecutor(8))
    levels = list(codec.DEFAULT_LEVELS)
    miss_tokens = [secrets.randbelow(49152) for _ in range(32 * 256)]
    hit_tokens = [secrets.randbelow(49152) for _ in range(32 * 256)]
    # a hit: chunk 0 stored at one level, so the index lists one chunk; either way the lookup is
    # one GET of the prefix index (no chunk object is read)
    contexts.save_chunks(contexts.keys(hit_tokens)[:1], _tiny_kv(), levels[:1])
    hit_keys = contexts.keys(hit_tokens)
    result = {}
    for name, tokens in (("miss", miss_tokens), ("hit_index", hit_tokens)):
        keys = contexts.keys(tokens)
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            found = find_stored_prefix(store, fingerprint, 256, keys, tokens, levels)
            samples.append(time.perf_counter() - t0)
            assert (len(found.chunks) > 0) == (name == "hit_index")
        result[name] = {"p50_ms": percentile(samples, 50) * 1000, "p99_ms": percentile(samples, 99) * 1000}
    result["requests_per_lookup"] = 1
    result["chunks_listed"] = len(hit_keys[:1])
    return result


def _tiny_kv():
    import torch

    return torch.zeros(30, 2, 3, 256, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", nargs="+", default=["lossless", "medium"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/serve.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.loading import convert_default_model, default_cache_dir

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
    context = real_text(tokenizer, args.tokens)
    messages = [{"role": "system", "content": context}, {"role": "user", "content": "Summarize the text."}]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer() as server:
        bucket = server.create_bucket()
        common = {"CACHEGEN_STORE_CACHE_BYTES": "0", "CACHEGEN_LOG_LEVEL": "warning"}
        envs = {
            "s3": {**server.env(), **common, "CACHEGEN_STORE": f"s3://{bucket}/bench"},
            "local": {**common, "CACHEGEN_STORE": f"file://{tmp}/store"},
        }
        lookup = bench_lookup(server, bucket, rounds=30)
        for source, env in envs.items():
            with GatewayProcess(env, Path(tmp) / f"{source}.log") as gw:
                body = {"messages": [{"role": "system", "content": context}], "levels": args.levels}
                created = httpx.post(f"{gw.url}/contexts", json=body, timeout=1800).json()
                ttft(gw.url, messages, {"kv_cache": False})  # warm-up
                if source == "s3":
                    runs = [ttft(gw.url, messages, {"kv_cache": False})[0] for _ in range(args.repeats)]
                    rows.append({"source": "recompute", "level": None, "ttft_s": statistics.median(runs),
                                 "runs_s": runs, "bytes": 0, "load_ms": 0.0})
                for level in args.levels:
                    results = [ttft(gw.url, messages, {"kv_quality": level}) for _ in range(args.repeats)]
                    info = results[-1][1]
                    rows.append({
                        "source": source,
                        "level": level,
                        "ttft_s": statistics.median(t for t, _ in results),
                        "runs_s": [t for t, _ in results],
                        "bytes": created["bytes"][level],
                        "cached_tokens": info["cached_tokens"],
                        "load_ms": info["load_ms"],
                        "prefill_ms": info["prefill_ms"],
                    })
    recompute = next(r["ttft_s"] for r in rows if r["source"] == "recompute")
    for r in rows:
        r["speedup_vs_recompute"] = recompute / r["ttft_s"]
    report = {"benchmark": "serve", "context_tokens": args.tokens, "rows": rows, "lookup_32_chunks_s3": lookup}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))

    print(f"{'source':>10} {'level':>9} {'TTFT s':>8} {'speedup':>8} {'load ms':>8} {'MB':>7}")
    for r in rows:
        print(f"{r['source']:>10} {str(r['level']):>9} {r['ttft_s']:>8.3f} {r['speedup_vs_recompute']:>7.1f}x "
              f"{r['load_ms']:>8.1f} {r['bytes'] / 1e6:>7.2f}")
    print(f"\nlookup of a 32-chunk prompt on S3 (one GET of the prefix index): "
          f"miss p50 {lookup['miss']['p50_ms']:.1f} ms, hit p50 {lookup['hit_index']['p50_ms']:.1f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
