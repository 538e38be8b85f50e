"""Two replicas over one S3 store behind vLLM's router: ``cache_aware`` against ``round_robin``.

    python -m benchmarks.scaleout [--requests 128] [--clients 4] [--out benchmarks/results/scaleout.json]

Starts SeaweedFS, two gateways (replicas ``a`` and ``b``) over one bucket and ``vllm-router`` in
front, all real processes on loopback. It stores 8 contexts of 2K-4K tokens once (``POST
/v1/contexts``), then for each policy restarts the gateways (cold memory) and the router, and
runs the same closed-loop workload: ``--clients`` clients send chats (a stored context as the
system message, then a question), the context drawn Zipf-like. Per policy it reports:

- memory-hot share: of the requests, those whose context came from the replica's memory prefix
  cache (``kv_cache_info.memory_tokens``), not fetched from S3;
- TTFT p50/p99 (client-side, streamed) and output tokens/s over the run;
- bytes read from S3 per request (``cachegen:kv_bytes_loaded`` over both replicas; the LRU object
  tier is off, so every stored chunk a request loads is a GET);
- how the requests split over the replicas (``kv_cache_info.replica``);
- the CPU time the gateways and everything else on the host (S3 server, router, clients) used.

Each replica's KV memory (``--kv-memory-mb``) holds about half the contexts: the regime where
routing matters (a working set that fits every replica is hot under any policy).

Before the policies, it measures what ``benchmarks/scaleout_sim.py`` needs (the per-replica costs
of a memory hit, a store hit and a decoded token, on one replica with one client) and writes
them into the JSON, which the simulation reads to predict 1-64 replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from app.threads import available_cores
from benchmarks.stats import percentile
from benchmarks.workload import (
    QUESTIONS,
    build_contexts,
    keywords,
    load_tokenizer,
    metric,
    pre_encode,
    zipf_draws,
)
from scheduler.loader import FETCH_WINDOW
from tests.gateway_process import GatewayProcess
from tests.support.router import RouterProcess, router_binary
from tests.support.seaweed import SeaweedServer

POLICIES = ("cache_aware", "round_robin")
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M at fp32: K and V, 30 layers, 3 KV heads of 64
STORE_HIT_CONTEXTS = (0, 1, 2)  # the contexts whose first load measures a store hit's costs


def chat(client: httpx.Client, model: str, context: str, question: str, max_tokens: int) -> dict[str, Any]:
    """One streamed chat: TTFT, output tokens and the kv_cache_info of its first chunk."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": context}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft, info, tokens = None, None, 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            info = info or event.get("kv_cache_info")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if ttft is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                ttft = time.perf_counter() - started
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - started, "tokens": tokens, "kv": info}


def bytes_loaded(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("cachegen:kv_bytes_loaded_total{"):
            total += float(line.split()[-1])
    return total


def per_token(result: dict[str, Any]) -> float:
    return (result["e2e_s"] - result["ttft_s"]) / max(1, result["tokens"] - 1)


def decode_pairs(urls: list[str], model: str, context: str, max_tokens: int) -> list[dict[str, Any]]:
    """Two sequences decoding together on each of ``urls``, all at once."""
    jobs = [(url, q) for url in urls for q in ("One?", "Two?")]

    def one(job: tuple[str, str]) -> dict[str, Any]:
        with httpx.Client(base_url=job[0], timeout=600) as client:
            return chat(client, model, context, job[1], max_tokens)

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def engine_busy_s(url: str) -> float:
    """The step loop's time in forward passes so far."""
    busy = metric(url, "cachegen:engine_busy_seconds")
    if busy is None:
        raise RuntimeError(f"{url}/metrics has no cachegen:engine_busy_seconds")
    return busy


def memory_hit(kv: dict[str, Any]) -> bool:
    """Whether a response's ``kv_cache_info`` says its context came from the replica's memory."""
    return kv["memory_tokens"] >= 0.9 * kv["cached_tokens"] > 0


def memory_hit_split(client: httpx.Client, url: str, model: str, context: str, repeats: int = 5) -> dict[str, float]:
    """Memory hits with one output token, one at a time: the TTFT, and of it the step loop's
    forward pass (the question's prefill) and the rest (HTTP, tokenization, planning, the
    stream's first event), each the median over ``repeats``."""
    ttfts, steps = [], []
    for i in range(repeats):
        busy = engine_busy_s(url)
        r = chat(client, model, context, f"Question {i}: who is mentioned first?", 1)
        steps.append(engine_busy_s(url) - busy)
        if not memory_hit(r["kv"]):
            raise RuntimeError(f"expected a memory hit, got {r['kv']}")
        ttfts.append(r["ttft_s"])
    return {
        "ttft_s": statistics.median(ttfts),
        "step_s": statistics.median(steps),
        "overhead_s": statistics.median(t - s for t, s in zip(ttfts, steps, strict=True)),
    }


def router_overhead(urls: list[str], root: Path, model: str, context: str, repeats: int = 5) -> float:
    """What ``cache_aware`` routing adds to a memory hit's TTFT: the same hit through vllm-router
    (which renders every request on every worker first) and straight to the replica it picks,
    alternating; the median of the differences."""
    router = RouterProcess(urls, "cache_aware", root / "router-costs.log")
    with router, httpx.Client(base_url=router.url, timeout=600) as via:
        first = chat(via, model, context, "Where does it start?", 1)  # warms the router's prefix tree
        direct_url = dict(zip("ab", urls, strict=True))[first["kv"]["replica"]]
        with httpx.Client(base_url=direct_url, timeout=600) as direct:
            gaps = []
            for i in range(repeats):
                routed = chat(via, model, context, f"Routed {i}: who is mentioned first?", 1)
                straight = chat(direct, model, context, f"Direct {i}: who is mentioned first?", 1)
                gaps.append(routed["ttft_s"] - straight["ttft_s"])
    return max(0.0, statistics.median(gaps))


def measure_costs(
    a: GatewayProcess,
    b: GatewayProcess,
    model: str,
    contexts: list[str],
    stored: list[dict],
    max_tokens: int,
    root: Path,
) -> dict:
    """Replica A alone (B stopped), one client: a fresh process's first store hit, then three
    more (cold memory), memory hits on the shortest and the longest context (split into the step
    loop's prefill and the per-request overhead around it), and decode speed at batch 1 and 2:
    the per-replica costs the simulation starts from. Then both replicas
    decoding two sequences each at once: how much this host slows a replica when the two share
    its cores (the simulation's replay of this run applies it; its grid, one replica per machine,
    does not), and what the router adds to a request."""
    with a, httpx.Client(base_url=a.url, timeout=600) as client:
        chunk_tokens = client.get("/get_server_info").json()["chunk_size"]
        # a fresh process's first store hit may pay its start-up (the store's first connection and
        # index read, the link estimate, the codec's first calls): kept apart from the others
        first = chat(client, model, contexts[-1], "What is this about?", max_tokens)
        colds = [chat(client, model, contexts[k], "What is this about?", max_tokens) for k in STORE_HIT_CONTEXTS]
        hot = chat(client, model, contexts[0], "Who is mentioned first?", max_tokens)
        split = memory_hit_split(client, a.url, model, contexts[0])
        split_long = memory_hit_split(client, a.url, model, contexts[-1])  # in memory since the warm-up
        long = chat(client, model, contexts[0], "Tell more.", 8 * max_tokens)
        pair = decode_pairs([a.url], model, contexts[0], 8 * max_tokens)
        with b:
            shared = decode_pairs([a.url, b.url], model, contexts[0], 8 * max_tokens)
            routing_s = router_overhead([a.url, b.url], root, model, contexts[0])
    stored_tokens = stored[0]["cached_tokens"]
    # the store hits' figures per token (their sums over their tokens), at context 0's length
    scale = stored_tokens / sum(stored[k]["cached_tokens"] for k in STORE_HIT_CONTEXTS)
    store_hit_ttft = scale * sum(cold["ttft_s"] for cold in colds)
    chunks = [c for cold in colds for c in cold["kv"]["chunks"]]
    per_token_2 = max(per_token(r) for r in pair)
    return {
        "context_tokens": stored_tokens,
        "store_hit_ttft_s": store_hit_ttft,
        "memory_hit_ttft_s": hot["ttft_s"],
        "memory_hit_step_s": split["step_s"],  # of a memory hit's TTFT, the step loop's prefill
        "long_context_tokens": stored[-1]["cached_tokens"],
        "memory_hit_step_long_s": split_long["step_s"],  # the same on the longest context
        "request_overhead_s": split["overhead_s"],  # the rest: HTTP, tokenization, planning
        "router_overhead_s": routing_s,  # what cache_aware routing adds to a request's TTFT
        "store_fetch_s": scale * sum(c["fetch_ms"] for c in chunks) / 1e3,
        "store_decode_s": scale * sum(c["decode_ms"] for c in chunks) / 1e3,
        "store_bytes": scale * sum(c["bytes"] for c in chunks),
        "store_chunks": len(chunks),
        # what a fresh process's first store hit (on the longest context) takes beyond a later one
        "first_store_hit_extra_s": max(
            0.0, first["ttft_s"] - store_hit_ttft * stored[-1]["cached_tokens"] / stored_tokens
        ),
        "store_hits": [
            {
                "tokens": stored[k]["cached_tokens"],
                "ttft_s": cold["ttft_s"],
                "bytes": sum(c["bytes"] for c in cold["kv"]["chunks"]),
            }
            for k, cold in zip(STORE_HIT_CONTEXTS, colds, strict=True)
        ],
        # a load reserves KV memory for the fetched chunks it holds beside its own KV, in tokens
        # (scheduler/loader.py, PrefixLoader.staging_bytes: the fetch window and the chunk decoding)
        "load_staging_tokens": (FETCH_WINDOW + 1) * chunk_tokens,
        "decode_s_per_token_batch1": per_token(long),
        "decode_s_per_token_batch2": per_token_2,  # each of two sequences decoding together
        "colocated_slowdown": statistics.fmean(per_token(r) for r in shared) / per_token_2,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_policy(
    policy: str,
    gateways: list[GatewayProcess],
    root: Path,
    model: str,
    contexts: list[str],
    args,
    seaweed_pid: int,
) -> dict[str, Any]:
    for gateway in gateways:
        gateway.start()  # cold: an empty memory prefix cache
    try:
        with RouterProcess([g.url for g in gateways], policy, root / f"router-{policy}.log") as router:
            loaded_before = sum(bytes_loaded(g.url) for g in gateways)
            # what else ran on this host's cores meanwhile: the S3 server, the router, the clients
            others = [seaweed_pid, router.proc.pid, os.getpid()]
            others_before = sum(cpu_seconds(pid) for pid in others)
            gateways_before = sum(cpu_seconds(g.proc.pid) for g in gateways)
            draws = zipf_draws(len(contexts), args.requests, args.zipf, args.seed)
            words = [keywords(c) for c in contexts]
            rng = random.Random(args.seed + 1)
            questions = [QUESTIONS[i % len(QUESTIONS)].format(rng.choice(words[k])) for i, k in enumerate(draws)]
            results: list[dict[str, Any]] = [{} for _ in draws]
            cursor = iter(range(len(draws)))
            lock = threading.Lock()

            def client_loop() -> None:
                with httpx.Client(base_url=router.url, timeout=600) as client:
                    while True:
                        with lock:
                            i = next(cursor, None)
                        if i is None:
                            return
                        results[i] = {"context": draws[i], **chat(client, model, contexts[draws[i]], questions[i], args.max_tokens)}

            started = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                for f in [pool.submit(client_loop) for _ in range(args.clients)]:
                    f.result()
            wall = time.perf_counter() - started
            s3_bytes = sum(bytes_loaded(g.url) for g in gateways) - loaded_before
            host_cpu = {
                "cores": available_cores(),
                "others_s": sum(cpu_seconds(pid) for pid in others) - others_before,
                "gateways_s": sum(cpu_seconds(g.proc.pid) for g in gateways) - gateways_before,
            }
    finally:
        for gateway in gateways:
            gateway.stop()
    return {**summarize(policy, results, wall, s3_bytes, args), "host_cpu": host_cpu}


def summarize(policy: str, results: list[dict], wall: float, s3_bytes: float, args) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in results]
    hot = [r for r in results if memory_hit(r["kv"])]
    replicas: dict[str, int] = {}
    for r in results:
        replicas[r["kv"]["replica"]] = replicas.get(r["kv"]["replica"], 0) + 1
    return {
        "policy": policy,
        "requests": len(results),
        "clients": args.clients,
        "memory_hot_share": len(hot) / len(results),
        "memory_token_share": sum(r["kv"]["memory_tokens"] for r in results)
        / max(1, sum(r["kv"]["cached_tokens"] for r in results)),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "s3_bytes_per_request": s3_bytes / len(results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "wall_s": wall,
        "by_replica": replicas,
        "per_request": [
            {"context": r["context"], "ttft_s": r["ttft_s"], "replica": r["kv"]["replica"],
             "memory_tokens": r["kv"]["memory_tokens"], "cached_tokens": r["kv"]["cached_tokens"]}
            for r in results
        ],  # fmt: skip
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--contexts", type=int, default=8)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens-context", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the context draws")
    # the 8 contexts' KV is 1.1 GB at fp32: each replica holds about half of it
    p.add_argument("--kv-memory-mb", type=int, default=560, help="each replica's KV memory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--levels", default="medium",
        help="the levels each context is stored at. One level (the default) makes every store hit "
        "load the same bytes, in the cost measurement and in the runs alike; with several, auto "
        "picks per request from its link estimate, and the two can differ (1.5-2x the bytes in one run)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scaleout.json"))
    args = p.parse_args()
    if router_binary() is None:
        raise SystemExit("vllm-router is not installed: pip install vllm-router==0.1.17")

    tokenizer = load_tokenizer("default")
    step = (args.max_tokens_context - args.min_tokens) // max(1, args.contexts - 1)
    contexts = [build_contexts(tokenizer, 1, args.min_tokens + k * step)[0].replace("Document 1 of 1", f"Document {k + 1}")
                for k in range(args.contexts)]  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="scaleout-"))
    with SeaweedServer(root / "s3") as seaweed:
        bucket = seaweed.create_bucket()
        common = {
            **seaweed.env(),
            "CACHEGEN_STORE": f"s3://{bucket}/kv",
            "CACHEGEN_STORE_CACHE_BYTES": "0",
            "CACHEGEN_KV_MEMORY_BYTES": str(args.kv_memory_mb * 2**20),
            "CACHEGEN_ENCODE_LEVELS": args.levels,
            # two replicas on this host's cores: a core each. With the default (the model thread's
            # OpenMP team on every core) two busy replicas spin against each other: a decode step
            # took 10x as long (docs/scaleout.md)
            "CACHEGEN_TORCH_THREADS": str(max(1, available_cores() // 2)),
        }
        gateways = [GatewayProcess({**common, "CACHEGEN_REPLICA": n}, root / f"{n}.log") for n in ("a", "b")]
        with gateways[0] as a:
            with httpx.Client(base_url=a.url, timeout=1200) as client:
                model = client.get("/v1/models").json()["data"][0]["id"]
                stored = pre_encode(client, contexts, None)
        # fresh processes: the contexts are in the store only
        costs = measure_costs(gateways[0], gateways[1], model, contexts, stored, args.max_tokens, root)
        print(f"per-replica costs: {json.dumps(costs)}")
        runs = [run_policy(policy, gateways, root, model, contexts, args, seaweed.pid) for policy in POLICIES]
    shutil.rmtree(root, ignore_errors=True)

    by = {r["policy"]: r for r in runs}
    ca, rr = by["cache_aware"], by["round_robin"]
    report = {
        "benchmark": "scaleout",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "contexts": [{"tokens": s["tokens"], "cached_tokens": s["cached_tokens"], "bytes": s["bytes"]} for s in stored],
        "costs": costs,
        "runs": runs,
        "ratios": {
            "hot_share_cache_aware_over_round_robin": ca["memory_hot_share"] / max(rr["memory_hot_share"], 1e-9),
            "ttft_p50_cache_aware_over_round_robin": ca["ttft_p50_s"] / rr["ttft_p50_s"],
            "s3_bytes_cache_aware_over_round_robin": ca["s3_bytes_per_request"] / max(rr["s3_bytes_per_request"], 1),
            "tokens_per_s_cache_aware_over_round_robin": ca["tokens_per_s"] / rr["tokens_per_s"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'policy':<12} {'hot share':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'S3 MB/req':>9} {'tok/s':>7}  split")
    for r in runs:
        print(
            f"{r['policy']:<12} {r['memory_hot_share']:>9.2f} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>8.3f}s "
            f"{r['s3_bytes_per_request'] / 1e6:>9.2f} {r['tokens_per_s']:>7.1f}  {r['by_replica']}"
        )
    print("ratios (cache_aware / round_robin): " + ", ".join(f"{k.split('_cache')[0]} {v:.2f}" for k, v in report["ratios"].items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
