"""Shared pieces of the adaptive-loading benchmark: methods, servers, the link, contexts, records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlparse

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent

from benchmarks.gateway_bench import ttft
from benchmarks.link_proxy import Trace
from benchmarks.tc_link import TcLink
from benchmarks.tc_link import available as tc_available
from codec.transform import cheap_inverse
from tests.gateway_process import GatewayProcess, free_port
from tests.support.seaweed import SeaweedServer

BASELINES_TABLE = "codec/levels/SmolLM2-135M-Instruct+baselines.json"
# the format-4 levels (scheme 2 on raw channels) that the transform levels replaced, run beside them
# under the names v4-high, v4-medium, v4-low (a store's index holds one object per level name)
V4_TABLE = "codec/levels/SmolLM2-135M-Instruct.v4.json"
V4_RENAMED = Path(tempfile.gettempdir()) / "cachegen-bench-v4-levels.json"
TRANSFORM_TABLE = "codec/levels/SmolLM2-135M-Instruct.json"  # format 5's transform levels
# "default": the gateway's built-in table (app.gateway.builtin_table): the transform levels where
# their inverse is cheap (a GPU, a CPU with native bf16), else format 4's. It is served from the
# file of the same levels that ``pre_encode`` stores:
# a store's index holds one object per level name, so the built-in table's format-4 levels, under
# the names the baselines' transform levels also have, would find only lossless there (an ``auto``
# of 17 lossless chunks, 7.8 s at 200 Mbit/s, where ``auto v4`` took 0.8 s).
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_BUILTIN = TRANSFORM_TABLE if cheap_inverse(_DEVICE) else str(V4_RENAMED)
TABLES = {
    "baselines": BASELINES_TABLE,
    "v4": str(V4_RENAMED),
    "transform": TRANSFORM_TABLE,
    "default": _BUILTIN,
}


def write_v4_table() -> None:
    """Format 4's table with its lossy levels renamed ``v4-<name>`` (``TABLES["v4"]``)."""
    table = json.loads((REPO / V4_TABLE).read_text())
    for level in table["levels"]:
        if level["scheme"] != "raw":
            level["name"] = f"v4-{level['name']}"
    table["default_level"] = f"v4-{table['default_level']}"
    V4_RENAMED.write_text(json.dumps(table))


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
    table: str = "baselines"  # the gateway's level table: a key of TABLES
    lru: bool = False  # the memory tiers on: the encoded-bytes LRU and the prefix cache of decoded KV
    warm_up: bool = False  # one request before the measured one, in the same process


def fixed_rate_methods(slo_ms: float | None) -> list[Method]:
    methods = [Method("recompute", {"kv_cache": False})]
    methods += [Method(level, {"kv_quality": level}) for level in FIXED_LEVELS]
    methods.append(Method("auto", {"kv_quality": "auto"}, table="default"))
    # format 4's levels and auto on them, in the same run (issue 18: old against new codec)
    methods += [
        Method(f"v4-{lv}", {"kv_quality": f"v4-{lv}"}, table="v4") for lv in ("high", "medium", "low")
    ]
    methods.append(Method("auto v4", {"kv_quality": "auto"}, table="v4"))
    methods.append(Method("auto transform", {"kv_quality": "auto"}, table="transform"))
    if slo_ms is not None:
        methods.append(Method("auto+slo", {"kv_quality": "auto", "kv_slo_ms": slo_ms}, table="default"))
    hot = Method("memory-hot lossless", {"kv_quality": "lossless"}, table="default", lru=True, warm_up=True)
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

    def gateway_env(self, endpoint: str, *, table: str, lru: bool) -> dict[str, str]:
        env = {
            **self.server.env(),
            "AWS_ENDPOINT_URL": endpoint,
            "CACHEGEN_STORE": f"s3://{self.bucket}/adaptive",
            "CACHEGEN_LOG_LEVEL": self.log_level,
        }
        env["CACHEGEN_LEVELS_FILE"] = str(REPO / TABLES[table])
        if not lru:  # every request loads over the link, also the trace's after the first
            env["CACHEGEN_STORE_CACHE_BYTES"] = "0"
            env["CACHEGEN_PREFIX_CACHE"] = "0"
        if self.torch_threads is not None:
            env["CACHEGEN_TORCH_THREADS"] = str(self.torch_threads)
        return env

    def gateway(self, endpoint: str, method: Method, log_name: str) -> GatewayProcess:
        env = self.gateway_env(endpoint, table=method.table, lru=method.lru)
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


class KernelLink:
    """benchmarks/tc_link.py behind Link's interface: the S3 port itself is shaped (``url`` is the
    server's), so no process of ours copies the bytes; a trace is played by a thread that changes
    the rate on schedule. Only in a private network namespace (``tc_link.enter_private_network``).
    """

    def __init__(
        self, target: str, *, rate_mbps: float | None = None, trace_file: Path | None = None
    ) -> None:
        self.target = target
        self.trace = Trace.load(trace_file) if trace_file is not None else None
        self.rate_bps = self.trace.rates_bps[0] if self.trace is not None else float(rate_mbps or 0) * 1e6
        self.link: TcLink | None = None
        self.started = 0.0
        self.description = ""
        self.stop_line = ""
        self._stop = threading.Event()
        self._player: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.target

    def start(self) -> KernelLink:
        self.link = TcLink(urlparse(self.target).port, self.rate_bps)
        self.started = time.perf_counter()
        self.description = self.link.describe()
        if self.trace is not None:
            self.description += f" (a trace every {self.trace.interval_ms:g} ms)"
            self._player = threading.Thread(target=self._play, name="tc-trace", daemon=True)
            self._player.start()
        return self

    def _play(self) -> None:
        assert self.trace is not None and self.link is not None
        step = self.trace.interval_ms / 1e3
        i = 1
        while not self._stop.wait(max(0.0, self.started + i * step - time.perf_counter())):
            self.link.set_rate(self.trace.rates_bps[i % len(self.trace.rates_bps)])
            i += 1

    def stop(self) -> None:
        self._stop.set()
        if self._player is not None:
            self._player.join()
        if self.link is not None:
            self.stop_line = f"{self.link.bytes_down} bytes down, {self.link.bytes_up} up"
            self.link.close()
            self.link = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_link(kind: str, target: str, **shape: Any) -> Link | KernelLink:
    """The benchmarks' link: 'tc' (the default where it runs: it holds the rate best, docs/adaptive.md)
    or 'proxy' (benchmarks/link_proxy.py as a process of its own)."""
    if kind == "tc":
        shape.pop("burst_ms", None)
        shape.pop("port", None)
        return KernelLink(target, **shape)
    return Link(target, **shape)


def default_link() -> str:
    return "tc" if tc_available() is None else "proxy"


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


def pre_encode(bench: Bench, contexts: list[Context], tables: tuple[str, ...] = ("baselines", "v4")) -> None:
    """Every context at every level of the baselines table and of format 4's table (its levels
    named ``v4-<level>``), straight to SeaweedFS (no proxy)."""
    write_v4_table()
    for table in tables:
        _pre_encode(bench, contexts, table)


def _pre_encode(bench: Bench, contexts: list[Context], table: str) -> None:
    method = Method("encode", {}, table=table)
    with bench.gateway(bench.server.endpoint_url, method, f"encode-{table}") as gw:
        for ctx in contexts:
            body = {"messages": [{"role": "system", "content": ctx.text}]}
            r = httpx.post(f"{gw.url}/contexts", json=body, timeout=1800)
            r.raise_for_status()
            created = r.json()
            ctx.tokens, ctx.encode_seconds = created["tokens"], created["encode_seconds"]
            ctx.bytes = {**ctx.bytes, **created["bytes"]}
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


def fmt_cell(value: float | None, width: int, spec: str = ".2f") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


# -- part 2: a varying link -------------------------------------------------------------------------------


def print_checks(checks: list[dict]) -> None:
    if not checks:
        return
    print("\ntargets:")
    for c in checks:
        verdict = {True: "met", False: "MISSED", None: "n/a"}[c["met"]]
        where = f"{c['rate_mbps']:g} Mbit/s {c['context']:>5}" if "rate_mbps" in c else "trace"
        print(
            f"  {where} {c['method']:>9} {c['target']:<42} {fmt_cell(c['value'], 7, '.3f')} "
            f"(limit {c['limit']:.3f})  {verdict}"
        )
