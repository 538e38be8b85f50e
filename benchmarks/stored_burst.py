"""Where a burst of questions on stored contexts spends its time, request by request.

    python -m benchmarks.stored_burst [--concurrent 8] [--rounds 3] [--baseline-env NAME=VALUE ...]

Issue 16's "worst TTFT of 8 concurrent questions on stored 2K contexts" as a
breakdown rather than one ratio. Each round starts a fresh gateway on a local
store that holds ``--concurrent`` + 2 pre-encoded 2K-token contexts, asks a
question on one (a warm-up: the first load's one-time costs), then on another
alone, then ``--concurrent`` at once, each on a context of its own, through
one HTTP client. Every question is a non-streamed chat with ``max_tokens`` 1,
so the request's time is its TTFT, and its ``kv_cache_info`` says how long its
load took (``load_ms``), how long it then waited for and ran its prefill
(``prefill_ms``), and the whole prompt from admission (``prompt_ms``). The
step loop's counters (``cachegen:engine_steps``, ``cachegen:engine_busy_seconds``)
say how many model steps the burst took and how long they ran.

With ``--baseline-env``, every round runs a gateway with those settings too,
the two in turns on the same store, and the summary gives both and their
ratio (for example ``CACHEGEN_HOLD_FOR_LOADS=false``).

Prints a table of the median round and writes JSON to
``benchmarks/results/stored_burst.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ab import parse_env
from benchmarks.vs_vllm import DEFAULT_MODEL_NAME, QUESTIONS, context_messages, gateway_env
from benchmarks.workload import build_contexts, load_tokenizer, pre_encode
from engine.loading import convert_default_model, default_cache_dir
from tests.gateway_process import REPO, GatewayProcess

RESULTS = REPO / "benchmarks" / "results"


async def ask(client: httpx.AsyncClient, url: str, text: str, t0: float) -> dict[str, Any]:
    """One question: when it was sent and answered (seconds after ``t0``) and its timings."""
    sent = time.perf_counter()
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": context_messages(text, QUESTIONS[0]),
        "max_tokens": 1,
        "temperature": 0,
    }
    response = await client.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    ended = time.perf_counter()
    info = response.json()["kv_cache_info"]
    return {
        "sent_s": round(sent - t0, 3),
        "ttft_s": round(ended - sent, 3),
        "cached_tokens": info["cached_tokens"],
        **{k: info[k] for k in ("load_ms", "prefill_ms", "prompt_ms")},
    }


def engine_counters(url: str) -> tuple[float, float]:
    """(model steps run, seconds in forward passes) from ``/metrics``."""
    text = httpx.get(f"{url}/metrics").text

    def value(name: str) -> float:
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        if found is None:
            raise SystemExit(f"/metrics has no {name}")
        return float(found.group(1))

    return value("cachegen:engine_steps"), value("cachegen:engine_busy_seconds")


def one_round(env: dict[str, str], texts: list[str], log: Path) -> dict[str, Any]:
    with GatewayProcess(env, log) as g:

        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient() as client:
                await ask(client, g.url, texts[0], time.perf_counter())  # warm-up
                alone = await ask(client, g.url, texts[1], time.perf_counter())
                steps0, busy0 = engine_counters(g.url)
                t0 = time.perf_counter()
                burst = await asyncio.gather(*(ask(client, g.url, text, t0) for text in texts[2:]))
                steps1, busy1 = engine_counters(g.url)
            return {
                "alone": alone,
                "burst": list(burst),
                "burst_steps": int(steps1 - steps0),
                "burst_busy_s": round(busy1 - busy0, 3),
            }

        result = asyncio.run(run())
    worst = max(r["ttft_s"] for r in result["burst"])
    result["worst_s"] = worst
    result["worst_over_alone"] = round(worst / result["alone"]["ttft_s"], 2)
    return result


def print_round(result: dict[str, Any]) -> None:
    print(
        f"{'request':>8s} {'sent s':>7s} {'TTFT s':>7s} {'load ms':>8s} {'prefill ms':>10s} {'prompt ms':>9s}"
    )
    for name, r in [("alone", result["alone"]), *((str(k), r) for k, r in enumerate(result["burst"]))]:
        print(
            f"{name:>8s} {r['sent_s']:7.3f} {r['ttft_s']:7.3f} {r['load_ms']:8.1f} "
            f"{r['prefill_ms']:10.1f} {r['prompt_ms']:9.1f}"
        )
    print(f"the burst: {result['burst_steps']} model steps, {result['burst_busy_s']} s in forward passes")


def summarize(name: str, rounds: list[dict[str, Any]]) -> dict[str, float]:
    median = sorted(rounds, key=lambda r: r["worst_over_alone"])[len(rounds) // 2]
    print(f"{name}: worst / alone per round: {[r['worst_over_alone'] for r in rounds]}; the median round:")
    print_round(median)
    return {
        "worst_over_alone_median": statistics.median(r["worst_over_alone"] for r in rounds),
        "alone_s_median": statistics.median(r["alone"]["ttft_s"] for r in rounds),
        "worst_s_median": statistics.median(r["worst_s"] for r in rounds),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--baseline-env", nargs="+", default=[], help="NAME=VALUE settings of a baseline")
    p.add_argument("--out", type=Path, default=RESULTS / "stored_burst.json")
    args = p.parse_args()
    model = convert_default_model(default_cache_dir())
    texts = build_contexts(load_tokenizer("default"), args.concurrent + 2, args.context_tokens)
    root = Path(tempfile.mkdtemp(prefix="stored_burst-"))
    env = gateway_env(model, "float32", root / "store")
    sides = {"this": env}
    if args.baseline_env:
        sides = {"baseline": env | parse_env(args.baseline_env), **sides}
    with GatewayProcess(env, root / "encode.log") as g, httpx.Client(base_url=g.url, timeout=900) as client:
        pre_encode(client, texts, None)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for k in range(args.rounds):
        order = list(sides) if k % 2 == 0 else list(reversed(sides))  # in turns: drift hits both
        for name in order:
            rounds[name].append(one_round(sides[name], texts, root / f"gateway-{name}.log"))
    summary = {name: summarize(name, rounds[name]) for name in sides}
    if args.baseline_env:
        summary["ratio_this_over_baseline"] = {
            key: round(summary["this"][key] / summary["baseline"][key], 3) for key in summary["this"]
        }
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {**vars(args), "out": str(args.out)}, "summary": summary,
                                    "rounds": rounds}, indent=1))  # fmt: skip
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
