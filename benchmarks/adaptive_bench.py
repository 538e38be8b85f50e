"""Adaptive KV loading over a throttled link: TTFT per method at fixed rates, SLO attainment on a trace.

Starts its own SeaweedFS, throttling proxies (benchmarks/link_proxy.py, each a process of its own)
and gateway processes, pre-encodes real contexts once with the level table that adds the paper's
baselines (fp16, int8) directly against SeaweedFS, then measures on the client clock (request sent
to first streamed content token, ``max_tokens`` 1):

Part 1, fixed link rates x contexts. Every request is served by a fresh gateway process, as in the
paper (a new process knows nothing of the link). Methods: ``recompute`` (``kv_cache: false``), each
fixed level (fp16, int8, lossless, high, medium, low; gateway on the baselines table, LRU off),
``auto`` (default table, LRU off, no budget), ``auto+slo`` (with ``--slo-ms``) and
``memory-hot lossless`` (default table, LRU on: one warm-up request, then the measured one in the
same process). Prints a table per rate and context, and the issue's targets, met or missed.

Part 2, a link whose rate follows a seeded random trace (20 Mbit/s to 2 Gbit/s, 500 ms steps).
One gateway process per method, ``--trace-requests`` sequential requests on a fixed schedule from
the trace's start (so every method meets the same rates at the same request slots while it keeps
up). ``high`` runs first and sets the SLO to its median TTFT (or ``--trace-slo-ms``); then every
other fixed level and ``auto`` with ``kv_slo_ms`` = that SLO (``--trace-methods``). Reports SLO
attainment, mean bits per value, mean TTFT. Target: auto meets the SLO in >= 95 % of requests,
with as many bits per value as the SLO allows.

On a shared machine pass ``--torch-threads 1`` (recorded): with torch's default of one thread per
core a descheduled thread stalls every operator, and a 15-token prefill then takes seconds.

    python -m benchmarks.adaptive_bench                                  # the full run
    python -m benchmarks.adaptive_bench --rates 200 --contexts 2048 --repeats 1 --trace-requests 4
    python -m benchmarks.adaptive_bench --skip-trace --slo-ms 700        # part 1 only, with auto+slo
    python -m benchmarks.adaptive_bench --trace-only --trace-slo-ms 900  # part 2 only

Writes JSON (``--out``): config, machine conditions (load average before and after each part,
CPUs, torch threads), the pre-encoded contexts, every request's record (kv_cache_info included),
summaries and target checks. Gateway logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

from benchmarks.adaptive_common import (
    FIXED_LEVELS,
    LLAMA_CPP_WARM_4K_S,
    Bench,
    Context,
    Method,
    default_link,
    describe,
    fixed_rate_methods,
    fmt_cell,
    link_check,
    loadavg,
    make_link,
    measure_fresh,
    median_record,
    ok,
    pre_encode,
    print_checks,
    question,
    ratio,
    sources_text,
)
from benchmarks.adaptive_trace import print_trace, run_trace
from benchmarks.gateway_bench import real_text
from benchmarks.tc_link import enter_private_network
from tests.support.seaweed import SeaweedServer


def run_fixed(
    bench: Bench,
    contexts: list[Context],
    methods: list[Method],
    args: argparse.Namespace,
    part: dict,
    checkpoint: Callable[[], None],
) -> None:
    """Fill ``part`` with link checks, records (saved after each), summaries and target checks."""
    records, link_checks = part.setdefault("records", []), part.setdefault("link_check_mbps", {})
    for rate in args.rates:
        with make_link(args.link, bench.server.endpoint_url, rate_mbps=rate, burst_ms=args.burst_ms) as link:
            link_checks[f"{rate:g}"] = link_check(bench.server, bench.bucket, link.url)
            print(
                f"\n{link.description}: one 4 MiB GET ran at {link_checks[f'{rate:g}']:.0f} Mbit/s",
                flush=True,
            )
            for ctx in contexts:
                for repeat in range(args.repeats):  # repeats outermost: drift in load hits every method alike
                    for method in methods:
                        log_name = f"fixed-{rate:g}-{ctx.size}-{method.name.replace(' ', '-')}"
                        record = measure_fresh(bench, link.url, method, ctx, question(repeat), log_name)
                        record.update(rate_mbps=rate, context=ctx.size, method=method.name, repeat=repeat)
                        records.append(record)
                        checkpoint()
                        print(
                            f"  {rate:>6g} Mbit/s {ctx.size:>5} {method.name:>20} #{repeat}: {describe(record)}",
                            flush=True,
                        )
    part["summaries"] = summarize_fixed(records)
    part["checks"] = check_fixed_targets(part["summaries"])


def summarize_fixed(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["rate_mbps"], r["context"], r["method"]), []).append(r)
    rows = []
    for (rate, ctx, method), runs in groups.items():
        good = ok(runs)
        mid = median_record(good) if good else {}
        rows.append(
            {
                "rate_mbps": rate,
                "context": ctx,
                "method": method,
                "ttft_s": statistics.median(r["ttft_s"] for r in good) if good else None,
                "runs_s": [r["ttft_s"] for r in runs],
                "failed": len(runs) - len(good),
                "gateway_ms": statistics.median(r["gateway_ms"] for r in good) if good else None,
                # the median run's
                **{
                    k: mid.get(k)
                    for k in ("bytes", "cached_tokens", "recomputed_tokens", "sources", "bits_per_value")
                },
            }
        )
    for row in rows:
        peers = {
            r["method"]: r["ttft_s"]
            for r in rows
            if (r["rate_mbps"], r["context"]) == (row["rate_mbps"], row["context"])
        }
        fixed = [peers[lv] for lv in FIXED_LEVELS if peers.get(lv) is not None]
        row["vs"] = {
            "recompute": ratio(row["ttft_s"], peers.get("recompute")),
            "int8": ratio(row["ttft_s"], peers.get("int8")),
            "fp16": ratio(row["ttft_s"], peers.get("fp16")),
            "memory_hot": ratio(row["ttft_s"], peers.get("memory-hot lossless")),
            "auto_v4": ratio(row["ttft_s"], peers.get("auto v4")),
            "best_fixed": ratio(row["ttft_s"], min(fixed)) if fixed else None,
        }
    return rows


def check_fixed_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets for ``auto`` (and ``auto+slo`` when run), per rate and context."""
    checks = []
    for row in rows:
        if not row["method"].startswith("auto"):
            continue
        rate, vs = row["rate_mbps"], row["vs"]
        targets = [("<= 1/6 x recompute", vs["recompute"], 1 / 6)]
        if rate in (200, 50):
            targets += [("<= 0.6 x int8", vs["int8"], 0.6), ("<= 0.4 x fp16", vs["fp16"], 0.4)]
        if rate == 200:
            targets.append(("<= 1.5 x memory-hot lossless", vs["memory_hot"], 1.5))
            if row["method"] == "auto transform":  # issue 18: the transform levels against format 4's
                targets.append(("<= 0.6 x auto on format 4's levels", vs["auto_v4"], 0.6))
        if rate == 1000:
            targets.append(("within 10% of the best fixed level", vs["best_fixed"], 1.1))
        if rate == 200 and row["context"] == 4096 and row["ttft_s"] is not None:
            targets.append(
                (f"TTFT <= {LLAMA_CPP_WARM_4K_S} s (llama.cpp warm hit)", row["ttft_s"], LLAMA_CPP_WARM_4K_S)
            )
        for name, value, limit in targets:
            checks.append(
                {
                    "rate_mbps": rate,
                    "context": row["context"],
                    "method": row["method"],
                    "target": name,
                    "value": value,
                    "limit": limit,
                    "met": None if value is None else value <= limit,
                }
            )
    return checks


def print_fixed(part: dict) -> None:
    rows = part["summaries"]
    for key in dict.fromkeys((r["rate_mbps"], r["context"]) for r in rows):
        rate, ctx = key
        print(
            f"\n== {rate:g} Mbit/s, {ctx}-token context (link check {part['link_check_mbps'][f'{rate:g}']:.0f} Mbit/s)"
        )
        print(
            f"{'method':>20} {'TTFT s':>7} {'gw ms':>7} {'MB':>7} {'bits':>5} {'cached':>6} {'recomp':>6} "
            f"{'/recomp':>7} {'/int8':>6} {'/fp16':>6} {'/hot':>6} {'/best':>6}  runs s / chunks"
        )
        for r in (r for r in rows if (r["rate_mbps"], r["context"]) == key):
            vs = r["vs"]
            cells = " ".join(
                fmt_cell(vs[k], w)
                for k, w in (("recompute", 7), ("int8", 6), ("fp16", 6), ("memory_hot", 6), ("best_fixed", 6))
            )
            runs = ",".join("failed" if t is None else f"{t:.3f}" for t in r["runs_s"])
            extra = (
                f"  {sources_text(r['sources'])}" if r["method"].startswith("auto") and r["sources"] else ""
            )
            mb = None if r["bytes"] is None else r["bytes"] / 1e6
            print(
                f"{r['method']:>20} {fmt_cell(r['ttft_s'], 7, '.3f')} {fmt_cell(r['gateway_ms'], 7, '.0f')} "
                f"{fmt_cell(mb, 7)} {fmt_cell(r['bits_per_value'], 5)} {fmt_cell(r['cached_tokens'], 6, 'd')} "
                f"{fmt_cell(r['recomputed_tokens'], 6, 'd')} {cells}  [{runs}]{extra}"
            )
    print_checks(part["checks"])


@contextlib.contextmanager
def measured(conditions: dict, name: str) -> Iterator[None]:
    """Load average before and after a part, and its wall time."""
    conditions[f"loadavg_before_{name}"] = loadavg()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        conditions[f"{name}_seconds"] = round(time.perf_counter() - t0, 1)
        conditions[f"loadavg_after_{name}"] = loadavg()


def conditions(args: argparse.Namespace) -> dict:
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "torch_threads": args.torch_threads if args.torch_threads is not None else "torch default",
        "loadavg_start": loadavg(),
    }


def comma_list(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rates", type=comma_list(float), default=[1000.0, 200.0, 50.0], help="Mbit/s, comma-separated"
    )
    p.add_argument(
        "--contexts",
        type=comma_list(int),
        default=[2048, 4096],
        help="context sizes in tokens, comma-separated",
    )
    p.add_argument("--repeats", type=int, default=3, help="fresh-process requests per method (part 1)")
    p.add_argument("--methods", type=comma_list(str), help="part 1 methods to run (default: all)")
    p.add_argument("--slo-ms", type=float, help="also run auto+slo in part 1 with this kv_slo_ms")
    p.add_argument("--link", choices=("tc", "proxy"), default=default_link(),
                   help="the emulated link: tc (default where it runs) or the link proxy")  # fmt: skip
    p.add_argument("--burst-ms", type=float, default=5.0, help="link proxy bucket size")
    part = p.add_mutually_exclusive_group()
    part.add_argument("--trace-only", action="store_true", help="part 2 only")
    part.add_argument("--skip-trace", action="store_true", help="part 1 only")
    p.add_argument("--trace-context", type=int, help="context size for part 2 (default: the largest)")
    p.add_argument("--trace-requests", type=int, default=20)
    p.add_argument("--trace-period-s", type=float, default=3.0, help="request slots, from the trace's start")
    p.add_argument("--trace-slo-ms", type=float, help="SLO for part 2 (default: median TTFT of high)")
    p.add_argument(
        "--trace-methods",
        type=comma_list(str),
        default=["fp16", "int8", "lossless", "medium", "low", "auto"],
        help="part 2 methods after high, which always runs first and sets the SLO (recompute: also allowed)",
    )
    p.add_argument("--trace-seed", type=int, default=0)
    p.add_argument("--trace-intervals", type=int, default=120)
    p.add_argument("--trace-interval-ms", type=float, default=500.0)
    p.add_argument(
        "--torch-threads", type=int, help="CACHEGEN_TORCH_THREADS for the gateways (default: unset)"
    )
    p.add_argument("--gateway-log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-dir", type=Path, default=Path("benchmarks/results/adaptive-logs"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/adaptive.json"))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if args.link == "tc":
        enter_private_network()  # re-executes this program in a namespace of its own, once
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop gateways, proxies, SeaweedFS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    methods = fixed_rate_methods(args.slo_ms)
    if args.methods:
        unknown = set(args.methods) - {m.name for m in methods}
        if unknown:
            sys.exit(f"unknown --methods {sorted(unknown)}; known: {[m.name for m in methods]}")
        methods = [m for m in methods if m.name in args.methods]
    unknown = set(args.trace_methods) - {"recompute", *FIXED_LEVELS, "auto"}
    if unknown:
        sys.exit(f"unknown --trace-methods {sorted(unknown)}")
    trace_size = args.trace_context or max(args.contexts)
    sizes = (
        [trace_size]
        if args.trace_only
        else sorted({*args.contexts, *([] if args.skip_trace else [trace_size])})
    )

    from transformers import AutoTokenizer

    from engine.loading import convert_default_model, default_cache_dir

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
    contexts = {n: Context(n, real_text(tokenizer, n)) for n in sizes}
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result: dict[str, Any] = {"benchmark": "adaptive", "config": config, "conditions": conditions(args)}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1))

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(SeaweedServer())  # its data directory goes with it
        bench = Bench(
            server, server.create_bucket(), args.log_dir, args.torch_threads, args.gateway_log_level
        )
        pre_encode(bench, list(contexts.values()))
        result["contexts"] = [c.summary() for c in contexts.values()]
        if not args.trace_only:
            with measured(result["conditions"], "fixed"):
                fixed = result["fixed"] = {}
                run_fixed(bench, [contexts[n] for n in args.contexts], methods, args, fixed, save)
        if not args.skip_trace:
            with measured(result["conditions"], "trace"):
                run_trace(bench, contexts[trace_size], args, result.setdefault("trace", {}), save)
    save()
    if "fixed" in result:
        print_fixed(result["fixed"])
    if "trace" in result:
        print_trace(result["trace"])
    print(f"\nconditions: {result['conditions']}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
