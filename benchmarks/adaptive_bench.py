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

    python3 benchmarks/adaptive_bench.py                                  # the full run
    python3 benchmarks/adaptive_bench.py --rates 200 --contexts 2048 --repeats 1 --trace-requests 4
    python3 benchmarks/adaptive_bench.py --skip-trace --slo-ms 700        # part 1 only, with auto+slo
    python3 benchmarks/adaptive_bench.py --trace-only --trace-slo-ms 900  # part 2 only

Writes JSON (``--out``): config, machine conditions (load average before and after each part,
CPUs, torch threads), the pre-encoded contexts, every request's record (kv_cache_info included),
summaries and target checks. Gateway logs go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gateway_bench import real_text, ttft
from benchmarks.link_proxy import Trace
from tests.gateway_process import GatewayProcess, free_port
from tests.support.seaweed import SeaweedServer

BASELINES_TABLE = "codec/levels/SmolLM2-135M-Instruct+baselines.json"
FIXED_LEVELS = ("fp16", "int8", "lossless", "high", "medium", "low")
VALUES_PER_TOKEN = 30 * 2 * 3 * 64  # SmolLM2-135M: layers x (K, V) x KV heads x head dim
LLAMA_CPP_WARM_4K_S = 0.69  # llama.cpp, warm prefix hit of a ~4K-token context on this machine
QUESTIONS = [
    "Summarize the text.",
    "What is the main topic of the text?",
    "Name three modules the text describes.",
    "Which class is described first?",
    "What does the text say about threads?",
    "Give one example of a function the text mentions.",
    "What is the text about, in one sentence?",
    "Which module handles paths?",
    "What does the text say about errors?",
    "List two data structures from the text.",
]
WARM_UP_QUESTION = "Repeat the first word of the text."


def question(i: int) -> str:
    base = QUESTIONS[i % len(QUESTIONS)]
    return base if i < len(QUESTIONS) else f"{base} (take {i // len(QUESTIONS) + 1})"


# -- the methods --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    name: str
    extra: dict[str, Any]  # request extension fields
    baselines: bool = True  # gateway on the baselines level table (else the default table)
    lru: bool = False  # in-memory LRU on (else every read goes over the link)
    warm_up: bool = False  # one request before the measured one, in the same process


def fixed_rate_methods(slo_ms: float | None) -> list[Method]:
    methods = [Method("recompute", {"kv_cache": False})]
    methods += [Method(level, {"kv_quality": level}) for level in FIXED_LEVELS]
    methods.append(Method("auto", {"kv_quality": "auto"}, baselines=False))
    if slo_ms is not None:
        methods.append(Method("auto+slo", {"kv_quality": "auto", "kv_slo_ms": slo_ms}, baselines=False))
    hot = Method("memory-hot lossless", {"kv_quality": "lossless"}, baselines=False, lru=True, warm_up=True)
    return [*methods, hot]


# -- processes: S3, links, gateways ---------------------------------------------------------------------


@dataclass
class Bench:
    """What every gateway of the run shares: the S3 server, the bucket, logs, thread and log settings."""

    server: SeaweedServer
    bucket: str
    log_dir: Path
    torch_threads: int | None
    log_level: str

    def gateway_env(self, endpoint: str, *, baselines: bool, lru: bool) -> dict[str, str]:
        env = {
            **self.server.env(),
            "AWS_ENDPOINT_URL": endpoint,
            "CACHEGEN_STORE": f"s3://{self.bucket}/adaptive",
            "CACHEGEN_LOG_LEVEL": self.log_level,
        }
        if baselines:
            env["CACHEGEN_LEVELS_FILE"] = str(REPO / BASELINES_TABLE)
        if not lru:
            env["CACHEGEN_STORE_CACHE_BYTES"] = "0"
        if self.torch_threads is not None:
            env["CACHEGEN_TORCH_THREADS"] = str(self.torch_threads)
        return env

    def gateway(self, endpoint: str, method: Method, log_name: str) -> GatewayProcess:
        env = self.gateway_env(endpoint, baselines=method.baselines, lru=method.lru)
        return GatewayProcess(env, self.log_dir / f"{log_name}.log")


class Link:
    """benchmarks/link_proxy.py as a process of its own (the rate holds at Gbit/s only that way)."""

    def __init__(
        self,
        target: str,
        *,
        rate_mbps: float | None = None,
        trace_file: Path | None = None,
        port: int | None = None,
        burst_ms: float = 5.0,
    ) -> None:
        self.target = target.removeprefix("http://")
        self.port = port or free_port()
        shape = ["--rate", f"{rate_mbps:g}mbit"] if trace_file is None else ["--trace", str(trace_file)]
        self.args = [
            sys.executable,
            str(REPO / "benchmarks" / "link_proxy.py"),
            *("--target", self.target, "--listen", f"127.0.0.1:{self.port}", "--burst-ms", f"{burst_ms:g}"),
            *shape,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.started = 0.0  # perf_counter when it listened (a trace starts then)
        self.description = ""
        self.stop_line = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Link:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        self.started = time.perf_counter()
        if not line.startswith("listening on"):
            rest = self.proc.communicate(timeout=10)[0]
            raise RuntimeError(f"link proxy did not start: {line}{rest}")
        self.description = line.strip()
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.stop_line = self.proc.communicate(timeout=10)[0].strip()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def link_check(server: SeaweedServer, bucket: str, endpoint: str, size: int = 4 * 2**20) -> float:
    """Mbit/s of one GET of ``size`` bytes through ``endpoint``: is the link the rate it was set to?"""
    import boto3
    from botocore.config import Config

    key = "adaptive-link-check"
    server.client().put_object(Bucket=bucket, Key=key, Body=os.urandom(size))
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=server.region,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(s3={"addressing_style": "path"}),
    )
    client.head_object(Bucket=bucket, Key=key)  # the connection is open before the clock starts
    t0 = time.perf_counter()
    body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return len(body) * 8 / (time.perf_counter() - t0) / 1e6


# -- requests -------------------------------------------------------------------------------------------


@dataclass
class Context:
    size: int  # tokens asked of real_text
    text: str
    tokens: int = 0  # the templated system message, as the gateway counts it
    bytes: dict[str, int] = field(default_factory=dict)  # stored bytes per level
    encode_seconds: float = 0.0

    def messages(self, q: str) -> list[dict]:
        return [{"role": "system", "content": self.text}, {"role": "user", "content": q}]

    def summary(self) -> dict:
        bits = {lv: n * 8 / (self.tokens * VALUES_PER_TOKEN) for lv, n in self.bytes.items()}
        return {
            "size": self.size,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "bits_per_value": bits,
            "encode_seconds": self.encode_seconds,
        }


def pre_encode(bench: Bench, contexts: list[Context]) -> None:
    """Every context at every level of the baselines table, straight to SeaweedFS (no proxy)."""
    method = Method("encode", {})
    with bench.gateway(bench.server.endpoint_url, method, "encode") as gw:
        for ctx in contexts:
            body = {"messages": [{"role": "system", "content": ctx.text}]}
            r = httpx.post(f"{gw.url}/contexts", json=body, timeout=1800)
            r.raise_for_status()
            created = r.json()
            ctx.tokens, ctx.bytes, ctx.encode_seconds = (
                created["tokens"],
                created["bytes"],
                created["encode_seconds"],
            )
            print(
                f"encoded {ctx.tokens} tokens in {ctx.encode_seconds:.1f} s: "
                + ", ".join(f"{lv} {n / 1e6:.1f} MB" for lv, n in ctx.bytes.items()),
                flush=True,
            )


def ask(url: str, ctx: Context, q: str, extra: dict) -> dict:
    """One streamed request with ``max_tokens`` 1; the client-clock TTFT and what the gateway reports.

    A failed request is a record too (``ttft_s`` None, ``error``): a long run goes on without it.
    """
    at, load = time.time(), os.getloadavg()[0]
    try:
        seconds, info = ttft(url, ctx.messages(q), {"max_tokens": 1, **extra})
    except (httpx.HTTPError, AssertionError) as exc:
        return failed(exc, at=at, loadavg_1m=load)
    return {**request_record(seconds, info), "at": at, "loadavg_1m": round(load, 2)}


def failed(exc: BaseException, **fields: Any) -> dict:
    return {"ttft_s": None, "error": f"{type(exc).__name__}: {exc}"[:2000], **fields}


def request_record(ttft_s: float, info: dict) -> dict:
    chunks = info.get("chunks") or []
    store = [c for c in chunks if c["source"] == "store"]
    load_ms, prefill_ms = info.get("load_ms") or 0.0, info.get("prefill_ms") or 0.0
    stored_tokens = sum(c["tokens"] for c in store)
    fetched = sum(c["bytes"] for c in store)
    return {
        "ttft_s": ttft_s,
        "gateway_ms": load_ms + prefill_ms,
        "load_ms": load_ms,
        "prefill_ms": prefill_ms,
        "bytes": fetched,
        "cached_tokens": info.get("cached_tokens", 0),
        "recomputed_tokens": info.get("recomputed_tokens", 0),
        "store_tokens": stored_tokens,
        "text_chunk_tokens": sum(c["tokens"] for c in chunks if c["source"] == "text"),
        "bits_per_value": fetched * 8 / (stored_tokens * VALUES_PER_TOKEN) if stored_tokens else None,
        "sources": dict(Counter(c["level"] or "text" for c in chunks)),
        "bandwidth_mbps": info.get("bandwidth_mbps"),
        "budget_ms": info.get("budget_ms"),
        "planned_ms": info.get("planned_ms"),
        "slo_met": info.get("slo_met"),
        "faults": info.get("faults", []),
        "chunks": chunks,
    }


def measure_fresh(bench: Bench, endpoint: str, method: Method, ctx: Context, q: str, log_name: str) -> dict:
    """One measured request on a fresh gateway process (after a warm-up request for memory-hot)."""
    try:
        with bench.gateway(endpoint, method, log_name) as gw:
            warm = ask(gw.url, ctx, WARM_UP_QUESTION, method.extra) if method.warm_up else None
            record = ask(gw.url, ctx, q, method.extra)
    except RuntimeError as exc:  # the gateway did not start; its log tail is in the message
        return failed(exc)
    if warm is not None:
        record["warm_up"] = {k: warm.get(k) for k in ("ttft_s", "error", "bytes", "load_ms", "sources")}
    return record


def describe(record: dict) -> str:
    """One progress line's worth of a record."""
    if record["ttft_s"] is None:
        return f"FAILED: {record['error'][:300]}"
    return (
        f"TTFT {record['ttft_s']:.3f} s (gateway {record['gateway_ms']:.0f} ms), "
        f"{record['bytes'] / 1e6:.1f} MB, {sources_text(record['sources'])}"
    )


# -- statistics -----------------------------------------------------------------------------------------


def median_record(records: list[dict]) -> dict:
    """The record of the median TTFT (the lower middle one for an even count)."""
    ordered = sorted(records, key=lambda r: r["ttft_s"])
    return ordered[(len(ordered) - 1) // 2]


def ok(records: list[dict]) -> list[dict]:
    return [r for r in records if r["ttft_s"] is not None]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def sources_text(sources: dict[str, int]) -> str:
    order = ["text", *FIXED_LEVELS]
    return " ".join(
        f"{sources[s]}x{s}" for s in sorted(sources, key=lambda s: order.index(s) if s in order else 99)
    )


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- part 1: fixed rates ----------------------------------------------------------------------------------


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
        with Link(bench.server.endpoint_url, rate_mbps=rate, burst_ms=args.burst_ms) as link:
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
                _fmt(vs[k], w)
                for k, w in (("recompute", 7), ("int8", 6), ("fp16", 6), ("memory_hot", 6), ("best_fixed", 6))
            )
            runs = ",".join("failed" if t is None else f"{t:.3f}" for t in r["runs_s"])
            extra = (
                f"  {sources_text(r['sources'])}" if r["method"].startswith("auto") and r["sources"] else ""
            )
            mb = None if r["bytes"] is None else r["bytes"] / 1e6
            print(
                f"{r['method']:>20} {_fmt(r['ttft_s'], 7, '.3f')} {_fmt(r['gateway_ms'], 7, '.0f')} "
                f"{_fmt(mb, 7)} {_fmt(r['bits_per_value'], 5)} {_fmt(r['cached_tokens'], 6, 'd')} "
                f"{_fmt(r['recomputed_tokens'], 6, 'd')} {cells}  [{runs}]{extra}"
            )
    print_checks(part["checks"])


def print_checks(checks: list[dict]) -> None:
    if not checks:
        return
    print("\ntargets:")
    for c in checks:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[c["met"]]
        where = f"{c['rate_mbps']:g} Mbit/s {c['context']:>5}" if "rate_mbps" in c else "trace"
        print(
            f"  {where} {c['method']:>9} {c['target']:<42} {_fmt(c['value'], 7, '.3f')} "
            f"(limit {c['limit']:.3f})  {verdict}"
        )


def _fmt(value: float | None, width: int, spec: str = ".2f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


# -- part 2: a varying link -------------------------------------------------------------------------------


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
    port = free_port()
    with (
        bench.gateway(f"http://127.0.0.1:{port}", method, f"trace-{method.name}") as gw,
        Link(bench.server.endpoint_url, trace_file=trace_file, port=port, burst_ms=args.burst_ms) as link,
    ):
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
    methods["auto"] = Method("auto", {"kv_quality": "auto", "kv_slo_ms": slo_ms}, baselines=False)
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
            f"{method:>10} {_fmt(s['slo_attainment'], 8, '.0%')} {_fmt(s['mean_bits_per_value'], 9)} "
            f"{_fmt(s['bits_per_value_all'], 8)} {_fmt(s['text_token_share'], 6, '.0%')} "
            f"{_fmt(s['mean_ttft_s'], 9, '.3f')} {_fmt(s['median_ttft_s'], 7, '.3f')} "
            f"{_fmt(s['max_ttft_s'], 7, '.3f')} {s['late_requests']:>4} {s['failed']:>6}"
        )
    print_checks(part["checks"])


# -- main -------------------------------------------------------------------------------------------------


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
