"""Part 2 of the adaptive-loading benchmark: a link whose rate follows a seeded trace, SLO attainment."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from benchmarks.adaptive_common import (
    FIXED_LEVELS,
    VALUES_PER_TOKEN,
    Bench,
    Context,
    Method,
    ask,
    describe,
    failed,
    fmt_cell,
    make_link,
    ok,
    print_checks,
    question,
)
from benchmarks.link_proxy import Trace
from tests.gateway_process import free_port


def make_trace(seed: int, intervals: int, interval_ms: float, low: float, high: float) -> dict:
    """Rates drawn log-uniformly between ``low`` and ``high`` Mbit/s, one per interval, from a fixed seed."""
    rng = random.Random(seed)
    rates = [round(math.exp(rng.uniform(math.log(low), math.log(high))), 1) for _ in range(intervals)]
    return {"interval_ms": interval_ms, "rates_mbps": rates}


def mean_rate(trace: Trace, start_s: float, seconds: float) -> float:
    """Mean link rate (Mbit/s) the trace held over [start, start + seconds]."""
    step = trace.interval_ms / 1e3
    t, end, bits = start_s, start_s + max(seconds, 1e-9), 0.0
    while t < end:
        boundary = min(end, (math.floor(t / step + 1e-9) + 1) * step)
        bits += trace.rate_at(t) * (boundary - t)
        t = boundary
    return bits / (end - start_s) / 1e6


def trace_series(
    bench: Bench,
    trace_file: Path,
    method: Method,
    ctx: Context,
    args: argparse.Namespace,
    records: list[dict],
    checkpoint: Callable[[], None],
) -> None:
    """``--trace-requests`` requests on one gateway process, at fixed slots from the trace's start.

    The gateway starts first, pointed at the proxy's port (it touches the store only on a request),
    then the proxy, so the trace starts when the first request is due. A request that overruns its
    slot delays the next one (``late_s``), which then meets other rates than the other methods did.
    """
    trace = Trace.load(trace_file)
    link = make_link(
        args.link, bench.server.endpoint_url, trace_file=trace_file, port=free_port(), burst_ms=args.burst_ms
    )
    with bench.gateway(link.url, method, f"trace-{method.name}") as gw, link:
        for i in range(args.trace_requests):
            due = link.started + i * args.trace_period_s
            time.sleep(max(0.0, due - time.perf_counter()))
            offset = time.perf_counter() - link.started
            record = ask(gw.url, ctx, question(i), method.extra)
            record.update(
                method=method.name,
                request=i,
                trace_offset_s=offset,
                late_s=max(0.0, offset - i * args.trace_period_s),
                rate_at_start_mbps=trace.rate_at(offset) / 1e6,
                mean_rate_mbps=None
                if record["ttft_s"] is None
                else mean_rate(trace, offset, record["ttft_s"]),
            )
            records.append(record)
            checkpoint()
            print(
                f"  trace {method.name:>9} #{i:<2} at {offset:6.2f} s "
                f"({record['rate_at_start_mbps']:5.0f} Mbit/s): {describe(record)}",
                flush=True,
            )


def summarize_trace(records: list[dict], slo_s: float) -> dict:
    """A failed request counts as a miss; TTFT statistics are over the answered ones."""
    ttfts = [r["ttft_s"] for r in ok(records)]
    bits = [r["bits_per_value"] for r in ok(records) if r["bits_per_value"] is not None]
    stored = sum(r["store_tokens"] for r in ok(records))
    loaded = sum(r["text_chunk_tokens"] + r["store_tokens"] for r in ok(records))
    return {
        "requests": len(records),
        "failed": len(records) - len(ttfts),
        "slo_attainment": sum(t <= slo_s for t in ttfts) / len(records) if records else None,
        "mean_ttft_s": statistics.fmean(ttfts) if ttfts else None,
        "median_ttft_s": statistics.median(ttfts) if ttfts else None,
        "max_ttft_s": max(ttfts, default=None),
        # over the requests that loaded anything; text chunks (exact, 0 bytes) show in text_token_share
        "mean_bits_per_value": statistics.fmean(bits) if bits else None,
        "bits_per_value_all": sum(r["bytes"] for r in ok(records)) * 8 / (stored * VALUES_PER_TOKEN)
        if stored
        else None,
        "text_token_share": sum(r["text_chunk_tokens"] for r in ok(records)) / loaded if loaded else None,
        "late_requests": sum(r["late_s"] > 0.05 for r in records),
    }


def trace_methods(names: list[str], slo_ms: float) -> list[Method]:
    methods = {"recompute": Method("recompute", {"kv_cache": False})}
    methods |= {lv: Method(lv, {"kv_quality": lv}) for lv in FIXED_LEVELS}
    methods["auto"] = Method("auto", {"kv_quality": "auto", "kv_slo_ms": slo_ms}, table="default")
    return [methods[name] for name in names if name != "high"]


def run_trace(
    bench: Bench, ctx: Context, args: argparse.Namespace, part: dict, checkpoint: Callable[[], None]
) -> None:
    """Fill ``part`` with the trace, the SLO, records (saved after each), summaries and target checks."""
    trace = make_trace(args.trace_seed, args.trace_intervals, args.trace_interval_ms, 20, 2000)
    trace_file = args.out.parent / "adaptive-trace.json"
    trace_file.write_text(json.dumps(trace))
    part.update(trace=trace, context=ctx.size)
    records = part.setdefault("records", [])
    print(
        f"\ntrace: {len(trace['rates_mbps'])} x {trace['interval_ms']:g} ms, "
        f"mean {statistics.fmean(trace['rates_mbps']):.0f} Mbit/s, context {ctx.tokens} tokens",
        flush=True,
    )
    trace_series(bench, trace_file, Method("high", {"kv_quality": "high"}), ctx, args, records, checkpoint)
    high = [r["ttft_s"] for r in ok(records)]
    if not (args.trace_slo_ms or high):
        raise RuntimeError("every request of high failed: no SLO to set (see the gateway logs)")
    slo_ms = part["slo_ms"] = args.trace_slo_ms or statistics.median(high) * 1000
    source = "given" if args.trace_slo_ms else "the median TTFT of high"
    print(f"  SLO: {slo_ms:.0f} ms ({source})", flush=True)
    for method in trace_methods(args.trace_methods, slo_ms):
        try:
            trace_series(bench, trace_file, method, ctx, args, records, checkpoint)
        except RuntimeError as exc:  # the gateway did not start
            records.append({**failed(exc), "method": method.name, "late_s": 0.0})
            print(f"  trace {method.name:>9}: FAILED to start: {exc}", flush=True)
    part["summaries"] = {
        m: summarize_trace([r for r in records if r["method"] == m], slo_ms / 1000)
        for m in dict.fromkeys(r["method"] for r in records)
    }
    part["checks"] = check_trace_targets(part["summaries"])


def check_trace_targets(summaries: dict[str, dict]) -> list[dict]:
    auto = summaries.get("auto")
    if auto is None or auto["slo_attainment"] is None:
        return []
    checks = [
        {
            "method": "auto",
            "target": "SLO attainment >= 95%",
            "value": auto["slo_attainment"],
            "limit": 0.95,
            "met": auto["slo_attainment"] >= 0.95,
        }
    ]
    # "bits as high as the SLO allows": at least those of the finest fixed level that meets the SLO as often
    meeting = [
        s["mean_bits_per_value"]
        for m, s in summaries.items()
        if m in FIXED_LEVELS and (s["slo_attainment"] or 0) >= 0.95 and s["mean_bits_per_value"] is not None
    ]
    if meeting and auto["mean_bits_per_value"] is not None:
        best = max(meeting)
        checks.append(
            {
                "method": "auto",
                "target": "bits/value >= finest fixed level meeting 95%",
                "value": auto["mean_bits_per_value"],
                "limit": best,
                "met": auto["mean_bits_per_value"] >= best,
            }
        )
    return checks


def print_trace(part: dict) -> None:
    print(f"\n== trace, {part['context']}-token context, SLO {part['slo_ms']:.0f} ms")
    print(
        f"{'method':>10} {'SLO met':>8} {'mean bits':>9} {'all bits':>8} {'text':>6} "
        f"{'mean TTFT':>9} {'median':>7} {'max':>7} {'late':>4} {'failed':>6}"
    )
    for method, s in part["summaries"].items():
        print(
            f"{method:>10} {fmt_cell(s['slo_attainment'], 8, '.0%')} {fmt_cell(s['mean_bits_per_value'], 9)} "
            f"{fmt_cell(s['bits_per_value_all'], 8)} {fmt_cell(s['text_token_share'], 6, '.0%')} "
            f"{fmt_cell(s['mean_ttft_s'], 9, '.3f')} {fmt_cell(s['median_ttft_s'], 7, '.3f')} "
            f"{fmt_cell(s['max_ttft_s'], 7, '.3f')} {s['late_requests']:>4} {s['failed']:>6}"
        )
    print_checks(part["checks"])


# -- main -------------------------------------------------------------------------------------------------
