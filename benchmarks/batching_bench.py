"""Continuous-batching benchmark: throughput and latency against concurrency, batching on vs off.

One gateway process per configuration, each on a fresh temporary store with
``CACHEGEN_MAX_QUEUE=64`` (so 32 clients are not rejected), reused across
its points:

* ``on``: the defaults; ``off``: ``CACHEGEN_MAX_NUM_SEQS=1`` (one sequence at a time).

Per configuration, two workloads (short chat prompts; questions on stored
~2K-token contexts pre-encoded with ``POST /contexts``) at each concurrency,
``--duration`` seconds a point, greedy, ``max_tokens`` 64 with ``ignore_eos``;
then the pre-encode interference probe: ``--probe-clients`` streams generate
long answers while the inter-token latency p99 is measured idle, then while a
fresh ~4K-token context is pre-encoded. Requests go through
``benchmarks/stream_client.py`` (closed loop: C clients).

Output tokens/s is counted over the measuring window only (content chunks
streamed before the deadline), so the drain after it does not dilute it.

Reports, with the targets pass/fail: tokens/s at C / at C=1 (>= 3.5x at 8,
>= 5x at 16), TTFT p99 on stored contexts at 8 clients / single-client TTFT
p50 (<= 3x), ITL p99 during a pre-encode / idle (<= 3x), batching on / off at
each point, errors by status (429s apart), the gateway's peak RSS (VmHWM) and
the KV budget when ``CACHEGEN_KV_MEMORY_BYTES`` is set. Writes
``benchmarks/results/batching_<timestamp>.json`` and prints a table.

    # the full run (2 minutes a point; 45 s a point took 38 minutes on 2 CPU cores)
    python -m benchmarks.batching_bench
    # a quick look
    python -m benchmarks.batching_bench --duration 20 --concurrency 1,8,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections import Counter
from datetime import datetime
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stream_client import (
    Load,
    RequestRecord,
    distribution,
    request_body,
    run_load,
    send_request,
    summarize,
    target,
)
from benchmarks.workload import (
    RequestSpec,
    build_contexts,
    build_requests,
    load_tokenizer,
    pre_encode,
    served_model,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CONFIGS = {"on": [], "off": ["CACHEGEN_MAX_NUM_SEQS=1"]}
WORKLOADS = ("short", "context")
BASE_ENV = ["CACHEGEN_MAX_QUEUE=64"]
PROBE_TAIL_S = 2.0
# (label, configuration, workload, concurrency, bound, "min" or "max"): tokens/s at C over C=1
TARGETS = (
    ("tok/s short C=8 / C=1", "on", "short", 8, 3.5, "min"),
    ("tok/s short C=16 / C=1", "on", "short", 16, 5.0, "min"),
    ("tok/s context C=8 / C=1", "on", "context", 8, 3.5, "min"),
    ("tok/s context C=16 / C=1", "on", "context", 16, 5.0, "min"),
)


# ---------------------------------------------------------------- one point


def point_args(opts: argparse.Namespace, concurrency: int, max_tokens: int) -> Load:
    """The client's settings for one point."""
    # enough specs that C clients never run out before the deadline (a request takes >= ~0.2 s)
    requests = concurrency * int(opts.duration * 5 + 4)
    return Load(concurrency, requests, opts.duration, max_tokens, opts.timeout, opts.ignore_eos)


def chunk_times(record: RequestRecord) -> list[float]:
    """When each content chunk of a request arrived, in seconds since its run started."""
    if record.ttft_ms is None:
        return []
    first = record.issued_s + record.ttft_ms / 1000
    return [first + gap / 1000 for gap in accumulate(record.itl_ms, initial=0.0)]


def window_throughput(records: list[RequestRecord], duration: float) -> float:
    """Output tokens/s counting only what streamed before the deadline (a chunk weighs tokens/chunks)."""
    tokens = 0.0
    for r in records:
        if not r.ok:
            continue
        times = chunk_times(r)
        if times:
            tokens += sum(t <= duration for t in times) * r.output_tokens / len(times)
    return tokens / duration


async def measure_point(
    client: httpx.AsyncClient, specs: list[RequestSpec], model: str, args: Load
) -> dict[str, Any]:
    records, duration, peak = await run_load(client, specs, model, args)
    summary = summarize(records, args.requests, duration, peak)
    summary["window_output_token_throughput"] = window_throughput(records, args.duration)
    if summary["requests_issued"] >= args.requests:
        print(f"note: all {args.requests} requests issued before the deadline; raise point_args' factor")
    return summary


def short_row(summary: dict[str, Any]) -> str:
    errors = ",".join(f"{k}:{n}" for k, n in summary["errors"].items()) or "-"
    return (
        f"{summary['requests_completed']} done, {summary['window_output_token_throughput']:.1f} tok/s, "
        f"TTFT p99 {fmt(summary['ttft_ms']['p99'])} ms, 429: {summary['requests_rejected']}, errors: {errors}"
    )


# ---------------------------------------------------------------- pre-encode interference


async def interference(
    client: httpx.AsyncClient, setup: httpx.Client, model: str, opts: argparse.Namespace, text: str
) -> dict[str, Any]:
    """ITL of ``--probe-clients`` running streams: idle, then while ``text`` is pre-encoded."""
    args = point_args(opts, opts.probe_clients, opts.probe_max_tokens)
    specs = build_requests([], 10_000, opts.seed + 1)
    streams: list[list[float]] = []  # content chunk times of each answer, kept when it is cut off
    errors: list[str] = []
    t0 = time.perf_counter()

    async def client_loop(k: int) -> None:
        for spec in specs[k :: opts.probe_clients]:
            streams.append(times := [])
            error = await stream_chunk_times(client, request_body(spec, model, args), times)
            if error:
                errors.append(error)
                await asyncio.sleep(0.5)

    tasks = [asyncio.create_task(client_loop(k)) for k in range(opts.probe_clients)]
    await asyncio.sleep(opts.probe_warmup)
    idle = (time.perf_counter() - t0, time.perf_counter() - t0 + opts.probe_idle)
    await asyncio.sleep(opts.probe_idle)
    began = time.perf_counter() - t0
    (encoded,) = await asyncio.to_thread(pre_encode, setup, [text], None)
    busy = (began, time.perf_counter() - t0)
    await asyncio.sleep(PROBE_TAIL_S)  # a stream stalled by the encode resumes: that gap must end to count
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    relative = [[t - t0 for t in times] for times in streams]
    idle_itl, busy_itl = window_gaps(relative, idle), window_gaps(relative, busy)
    idle_p99, busy_p99 = distribution(idle_itl)["p99"], distribution(busy_itl)["p99"]
    return {
        "clients": opts.probe_clients,
        "max_tokens": opts.probe_max_tokens,
        "context": encoded,
        "idle_window_s": idle,
        "encode_window_s": busy,
        "idle_itl_ms": distribution(idle_itl),
        "encode_itl_ms": distribution(busy_itl),
        "idle_gaps": len(idle_itl),
        "encode_gaps": len(busy_itl),
        "itl_p99_ratio": busy_p99 / idle_p99 if idle_p99 and busy_p99 else None,
        "answers_started": len(streams),
        "errors": dict(Counter(errors)),
    }


async def stream_chunk_times(
    client: httpx.AsyncClient, body: dict[str, Any], times: list[float]
) -> str | None:
    """Stream one answer, appending each content chunk's arrival to ``times`` as it comes.

    stream_client's ``send_request`` hands its chunk times over only at the end; the
    probe cuts its answers off, and wants what they streamed until then.
    """
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return str(response.status_code)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return "stream error"
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return None


def window_gaps(streams: list[list[float]], window: tuple[float, float]) -> list[float]:
    """Inter-token gaps (ms) that overlap ``window``; times in seconds since the probe started."""
    return [
        (b - a) * 1000 for times in streams for a, b in pairwise(times) if a < window[1] and b > window[0]
    ]


def probe_text(tokens: int) -> str:
    """A ~``tokens``-token context no store has seen: a unique title in front of real prose."""
    (text,) = build_contexts(load_tokenizer("default"), 1, tokens)
    return f"Probe {uuid.uuid4().hex}.\n\n{text}"


# ---------------------------------------------------------------- one configuration


def run_config(name: str, opts: argparse.Namespace, contexts: list[str]) -> dict[str, Any]:
    env = BASE_ENV + CONFIGS[name] + opts.gateway_env
    budget = dict(e.split("=", 1) for e in env).get("CACHEGEN_KV_MEMORY_BYTES")
    budget = budget or os.environ.get("CACHEGEN_KV_MEMORY_BYTES")
    print(f"==> configuration {name}: {' '.join(env)}")
    with target(None, env) as started:
        with httpx.Client(base_url=started.url, timeout=max(opts.timeout, 900.0)) as setup:
            model = served_model(setup)
            encoded = pre_encode(setup, contexts, None) if "context" in opts.workloads else []
            result = asyncio.run(measure_config(started.url, setup, model, opts, contexts))
        peak_rss = started.peak_rss_bytes()
    return {
        "gateway_env": env,
        "model": model,
        "kv_memory_bytes": int(budget) if budget else None,
        "peak_rss_mib": None if peak_rss is None else round(peak_rss / 2**20, 1),
        "contexts": encoded,
        **result,
    }


async def measure_config(
    url: str, setup: httpx.Client, model: str, opts: argparse.Namespace, contexts: list[str]
) -> dict[str, Any]:
    pool = max([*opts.concurrency, opts.probe_clients]) + 2
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(opts.timeout)) as client:
        await warm_up(client, model, opts, contexts)
        points = []
        most = point_args(opts, max(opts.concurrency), opts.max_tokens).requests
        for workload in opts.workloads:
            specs = build_requests(contexts if workload == "context" else [], most, opts.seed)
            for c in opts.concurrency:
                summary = await measure_point(client, specs, model, point_args(opts, c, opts.max_tokens))
                print(f"  {workload:<8} C={c:<3} {short_row(summary)}")
                points.append({"workload": workload, "concurrency": c, "summary": summary})
        probe = None
        if opts.probe_clients:
            print(
                f"  pre-encode probe: {opts.probe_clients} streams, {opts.probe_context_tokens} tokens encoded"
            )
            probe = await interference(client, setup, model, opts, probe_text(opts.probe_context_tokens))
            print(f"  pre-encode probe: ITL p99 idle {fmt(probe['idle_itl_ms']['p99'])} ms, "
                  f"during encode {fmt(probe['encode_itl_ms']['p99'])} ms")  # fmt: skip
    return {"points": points, "interference": probe}


async def warm_up(
    client: httpx.AsyncClient, model: str, opts: argparse.Namespace, contexts: list[str]
) -> None:
    """One short request, and one on each stored context: first-use costs stay out of C=1."""
    args = point_args(opts, 1, 4)
    used = contexts if "context" in opts.workloads else []
    for spec in build_requests([], 1, opts.seed) + build_requests(used, len(used), opts.seed + 2):
        record = await send_request(client, spec, request_body(spec, model, args), time.perf_counter(), 600)
        if not record.ok:
            raise SystemExit(f"warm-up request failed ({record.status}): {record.error}")


# ---------------------------------------------------------------- ratios, targets, table


def ratios(configs: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s against C=1, TTFT p99 at 8 against single-client p50, on against off."""
    out: dict[str, Any] = {"speedup": {}, "ttft_p99_c8_over_p50_c1": {}, "on_over_off": {}}
    tok_s = {
        (name, p["workload"], p["concurrency"]): p["summary"]["window_output_token_throughput"]
        for name, config in configs.items()
        for p in config["points"]
    }
    for (name, workload, c), value in tok_s.items():
        if tok_s.get((name, workload, 1)):
            out["speedup"][f"{name}/{workload}/{c}"] = value / tok_s[name, workload, 1]
        if name == "on" and tok_s.get(("off", workload, c)):
            out["on_over_off"][f"{workload}/{c}"] = value / tok_s["off", workload, c]
    for name, config in configs.items():
        ttft = {(p["workload"], p["concurrency"]): p["summary"]["ttft_ms"] for p in config["points"]}
        single, loaded = ttft.get(("context", 1)), ttft.get(("context", 8))
        if single and loaded and single["p50"] and loaded["p99"]:
            out["ttft_p99_c8_over_p50_c1"][name] = loaded["p99"] / single["p50"]
    return out


def targets(configs: dict[str, Any], found: dict[str, Any]) -> list[dict[str, Any]]:
    checks = [(label, found["speedup"].get(f"{cfg}/{wl}/{c}"), bound, kind)
              for label, cfg, wl, c, bound, kind in TARGETS]  # fmt: skip
    checks.append(("TTFT p99 context C=8 / C=1 p50", found["ttft_p99_c8_over_p50_c1"].get("on"), 3.0, "max"))
    probe = (configs.get("on") or {}).get("interference") or {}
    checks.append(("ITL p99 during pre-encode / idle", probe.get("itl_p99_ratio"), 3.0, "max"))
    rows = []
    for label, value, bound, kind in checks:
        passed = None if value is None else value >= bound if kind == "min" else value <= bound
        rows.append({"target": label, "value": value, "bound": f"{'>=' if kind == 'min' else '<='} {bound}x",
                     "passed": passed})  # fmt: skip
    return rows


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_tables(configs: dict[str, Any], found: dict[str, Any], checks: list[dict[str, Any]]) -> None:
    print("\n| config | workload | C | done | tok/s | x C=1 | on/off | TTFT p50 | TTFT p99 | ITL p99 | 429 "
          "| errors |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, config in configs.items():
        for p in config["points"]:
            s, key = p["summary"], f"{p['workload']}/{p['concurrency']}"
            on_off = found["on_over_off"].get(key) if name == "on" else None
            errors = ",".join(f"{k}:{n}" for k, n in s["errors"].items()) or "-"
            print(f"| {name} | {p['workload']} | {p['concurrency']} | {s['requests_completed']} "
                  f"| {fmt(s['window_output_token_throughput'])} | {fmt(found['speedup'].get(f'{name}/{key}'), 2)} "
                  f"| {fmt(on_off, 2)} | {fmt(s['ttft_ms']['p50'])} | {fmt(s['ttft_ms']['p99'])} "
                  f"| {fmt(s['itl_ms']['p99'])} | {s['requests_rejected']} | {errors} |")  # fmt: skip
    print("\n| config | ITL p99 idle | ITL p99 pre-encode | ratio | encode s | peak RSS MiB | KV budget |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, config in configs.items():
        probe = config["interference"] or {}
        encode = (probe.get("context") or {}).get("encode_seconds")
        print(f"| {name} | {fmt((probe.get('idle_itl_ms') or {}).get('p99'))} "
              f"| {fmt((probe.get('encode_itl_ms') or {}).get('p99'))} | {fmt(probe.get('itl_p99_ratio'), 2)} "
              f"| {fmt(encode, 2)} | {fmt(config['peak_rss_mib'])} | {config['kv_memory_bytes'] or '-'} |")  # fmt: skip
    print("\nTargets (batching on):")
    for row in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[row["passed"]]
        print(f"  {verdict:<5} {row['target']:<36} {fmt(row['value'], 2):>7}  (target {row['bound']})")


# ---------------------------------------------------------------- main


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=_names, default=list(CONFIGS), help="comma-separated: on,off")
    p.add_argument("--workloads", type=_names, default=list(WORKLOADS), help="comma-separated: short,context")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 8, 16, 32], help="comma-separated")
    p.add_argument("--duration", type=float, default=120.0, help="seconds a point (no request issued after)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end answers")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, whole stream (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra setting for both gateways (repeatable)")  # fmt: skip
    ctx = p.add_argument_group("stored contexts")
    ctx.add_argument("--num-contexts", type=int, default=8)
    ctx.add_argument("--context-tokens", type=int, default=2048)
    probe = p.add_argument_group("pre-encode interference probe")
    probe.add_argument("--probe-clients", type=int, default=4, help="running streams; 0: skip the probe")
    probe.add_argument("--probe-max-tokens", type=int, default=1024, help="long answers that outlast it")
    probe.add_argument("--probe-context-tokens", type=int, default=4096)
    probe.add_argument("--probe-warmup", type=float, default=5.0, help="s before the idle window")
    probe.add_argument("--probe-idle", type=float, default=15.0, help="s of the idle window")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/batching_<timestamp>.json")
    opts = p.parse_args(argv)
    if unknown := set(opts.configs) - set(CONFIGS) or set(opts.workloads) - set(WORKLOADS):
        p.error(f"unknown configuration or workload: {sorted(unknown)}")
    if not opts.concurrency or min(opts.concurrency) < 1 or opts.duration <= 0:
        p.error("--concurrency needs positive counts and --duration a positive time")
    if any("=" not in e for e in opts.gateway_env):
        p.error("--gateway-env takes KEY=VALUE")
    return opts


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _names(text)]


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    # on SIGTERM (timeout, kill) unwind, so the gateways this tool started are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = opts.out or RESULTS_DIR / f"batching_{datetime.now():%Y%m%d_%H%M%S}.json"
    contexts = []
    if "context" in opts.workloads:
        contexts = build_contexts(load_tokenizer("default"), opts.num_contexts, opts.context_tokens)
    started = time.time()
    configs = {name: run_config(name, opts, contexts) for name in opts.configs}
    found = ratios(configs)
    checks = targets(configs, found)
    print_tables(configs, found, checks)
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()}
    result = {"options": options, "started": started, "wall_s": time.time() - started,
              "configs": configs, "ratios": found, "targets": checks}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
