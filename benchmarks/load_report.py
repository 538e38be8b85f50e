"""The load tool's results: one record per request, the summary (percentiles, throughput, errors,
SLO attainment), the printed table and the PNG plot. Used by ``benchmarks/load_test.py``."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile

PERCENTILES = (50, 90, 99)


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
    output_tokens_from: str = "usage"  # "usage", or "chunks" when the server sent no usage
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    kv_cache_info: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


# ---------------------------------------------------------------- summary


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


def slo_summary(ok: list[RequestRecord], duration: float, args: argparse.Namespace) -> dict[str, Any] | None:
    if args.slo_ttft_ms is None and args.slo_e2e_ms is None:
        return None

    def meets(r: RequestRecord) -> bool:
        ttft_ok = args.slo_ttft_ms is None or (r.ttft_ms is not None and r.ttft_ms <= args.slo_ttft_ms)
        e2e_ok = args.slo_e2e_ms is None or (r.e2e_ms is not None and r.e2e_ms <= args.slo_e2e_ms)
        return ttft_ok and e2e_ok

    good = sum(meets(r) for r in ok)
    return {
        "ttft_ms": args.slo_ttft_ms,
        "e2e_ms": args.slo_e2e_ms,
        "attainment": good / len(ok) if ok else None,
        "goodput_requests_per_s": good / duration if duration else None,
    }


def kv_summary(ok: list[RequestRecord]) -> dict[str, Any] | None:
    infos = [r.kv_cache_info for r in ok if r.kv_cache_info]
    if not infos:
        return None
    total = {key: sum(i.get(key) or 0 for i in infos) for key in ("cached_tokens", "recomputed_tokens")}
    loads = [i["load_ms"] for i in infos if isinstance(i.get("load_ms"), int | float)]
    return {"requests": len(infos), **total, "load_ms": distribution(loads)}


def summarize(
    records: list[RequestRecord], planned: int, duration: float, peak: int, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    output = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration) if duration else (lambda n: 0.0)
    return {
        "duration_s": duration,
        "requests_planned": planned,
        "requests_issued": len(records),
        "requests_completed": len(ok),
        "requests_rejected": sum(r.rejected for r in records),
        "errors": error_counts(records),
        "peak_in_flight": peak,
        "total_prompt_tokens": prompt,
        "total_output_tokens": output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_tokens_from_usage": all(r.output_tokens_from == "usage" for r in ok),
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output),
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "slo": slo_summary(ok, duration, args),
        "kv_cache_info": kv_summary(ok),
    }


def print_table(summary: dict[str, Any]) -> None:
    def row(label: str, value: Any) -> None:
        text = "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{text:>12}")

    print("{s:=^52}".format(s=" Serving Benchmark Result "))
    row("Successful requests:", summary["requests_completed"])
    row("Rejected requests (429):", summary["requests_rejected"])
    row("Failed requests:", sum(summary["errors"].values()))
    for key, n in summary["errors"].items():
        row(f"  {key}:", n)
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_prompt_tokens"])
    row("Total cached input tokens:", summary["total_cached_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Peak requests in flight:", summary["peak_in_flight"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_token_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if summary["slo"] is not None:
        row("SLO attainment:", summary["slo"]["attainment"])
        row("Request goodput (req/s):", summary["slo"]["goodput_requests_per_s"])
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):  # fmt: skip
        name = key.split("_")[0].upper()
        print("{s:-^52}".format(s=f" {title} "))
        row(f"Mean {name} (ms):", summary[key]["mean"])
        for q in PERCENTILES:
            row(f"P{q} {name} (ms):", summary[key][f"p{q}"])
    print("=" * 52)


# ---------------------------------------------------------------- outputs


def write_plot(records: list[RequestRecord], path: Path) -> bool:
    """TTFT and e2e latency per request against issue time, and their CDFs. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot (pip install matplotlib)")
        return False
    ok = [r for r in records if r.ok and r.ttft_ms is not None]
    failed = [r for r in records if not r.ok]
    fig, (over_time, cdf) = plt.subplots(1, 2, figsize=(12, 4.5))
    for attr, label in (("e2e_ms", "end-to-end"), ("ttft_ms", "TTFT")):
        over_time.scatter([r.issued_s for r in ok], [getattr(r, attr) for r in ok], s=10, label=label)
        values = sorted(getattr(r, attr) for r in ok)
        cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label)
    if failed:
        over_time.scatter(
            [r.issued_s for r in failed], [0] * len(failed), marker="x", c="red", label="failed"
        )
    over_time.set(xlabel="issued at (s)", ylabel="latency (ms)", title="Latency per request")
    cdf.set(xlabel="latency (ms)", ylabel="fraction of requests", title="Latency CDF", ylim=(0, 1.02))
    for ax in (over_time, cdf):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
