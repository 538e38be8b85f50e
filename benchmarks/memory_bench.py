"""Peak memory under load against what the gateway accounts for (issue 19, finding 6).

One local store, contexts pre-encoded once; then, per configuration, a fresh gateway process with
the default KV budget (2 GiB) and LRU tier (512 MiB) serves ``--clients`` closed-loop clients
asking questions on the stored contexts for ``--duration`` seconds, while this tool samples the
gateway's resident memory every 0.25 s. The bound is the issue's: KV budget + weights + LRU tier,
plus 10%.

Configurations: ``glibc`` (the C allocator's defaults: an arena per thread, a dynamic mmap
threshold) against ``default`` (what the gateway sets up at start, ``app/allocator.py``).

    python -m benchmarks.memory_bench                        # 32 clients, 60 s, both configurations
    python -m benchmarks.memory_bench --clients 8 --duration 20 --configs default
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from benchmarks.stream_client import Load, run_load, summarize
from benchmarks.workload import build_contexts, build_requests, load_tokenizer, metric, pre_encode
from tests.gateway_process import GatewayProcess

RESULTS = Path(__file__).resolve().parent / "results" / "memory_bench.json"
KV_BUDGET = 2 * 2**30
LRU_BYTES = 512 * 2**20
# the tier is set, not left to its default (none in front of a local store): the bound counts it
_TIER = {"CACHEGEN_STORE_CACHE_BYTES": str(LRU_BYTES)}
CONFIGS = {
    "glibc": {"CACHEGEN_MALLOC_TUNING": "false", **_TIER},
    "default": _TIER,
    "no-prefault": {"CACHEGEN_KV_PREFAULT": "false", **_TIER},  # the KV pool faulted in as it is used
    "no-trim": {"CACHEGEN_MALLOC_TRIM_INTERVAL_S": "0", **_TIER},  # free arena pages stay (app/malloc_trim.py)
}


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


class Sampler(threading.Thread):
    """RSS of ``pid`` and the gateway's KV accounting every ``period_s`` until stopped."""

    def __init__(self, pid: int, url: str, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.url, self.period_s = pid, url, period_s
        self.stop = threading.Event()
        self.rss: list[int] = []
        self.kv_used: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.rss.append(rss_bytes(self.pid))
            if len(self.rss) % 8 == 0:  # /metrics every 2 s: its own cost stays out of the figure
                self.kv_used.append(metric(self.url, "cachegen:kv_memory_used_bytes") or 0.0)


def smaps_breakdown(pid: int) -> dict[str, float]:
    """Resident MiB of ``pid`` by what holds it: the KV pool (a shared anonymous mapping), the
    weights (their safetensors file, mapped), shared libraries, and the heap and other anonymous
    memory (the C allocator's arenas: the LRU tier's bytes, activations, Python objects)."""
    out: dict[str, float] = {}
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
            path = head[5] if len(head) > 5 else ""
            if path.startswith("/dev/zero") or path.startswith("/memfd:"):
                kind = "kv_pool"
            elif path.endswith(".safetensors"):
                kind = "weights_file"
            elif ".so" in path:
                kind = "libraries"
            elif path in ("", "[heap]") or path.startswith("[anon"):
                kind = "heap_and_anon"
            else:
                kind = "other"
        elif line.startswith("Rss:"):
            out[kind] = out.get(kind, 0.0) + int(line.split()[1]) / 1024
    return out


def weights_bytes() -> int:
    from engine.loading import convert_default_model, default_cache_dir

    return sum(p.stat().st_size for p in Path(convert_default_model(default_cache_dir())).glob("*.safetensors"))


def measure(name: str, store: Path, contexts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    env = {"CACHEGEN_STORE": f"file://{store}", "CACHEGEN_MAX_QUEUE": str(2 * args.clients), **CONFIGS[name]}
    with tempfile.TemporaryDirectory() as tmp, GatewayProcess(env, Path(tmp) / "gateway.log") as gw:
        assert gw.proc is not None
        with httpx.Client(base_url=gw.url, timeout=900) as client:
            encoded = pre_encode(client, contexts, None)  # stored by the first configuration already
        before = rss_bytes(gw.proc.pid)
        sampler = Sampler(gw.proc.pid, gw.url)
        sampler.start()
        load = Load(args.clients, args.clients * int(args.duration * 5 + 4), args.duration, args.max_tokens)
        specs = build_requests(contexts, load.requests, seed=0)
        records, duration, peak = asyncio.run(_run(gw.url, specs, load))
        sampler.stop.set()
        sampler.join()
        hwm = rss_bytes(gw.proc.pid, "VmHWM")
        breakdown = smaps_breakdown(gw.proc.pid)
        summary = summarize(records, load.requests, duration, peak)
    return {
        "config": name,
        "env": CONFIGS[name],
        "contexts": encoded,
        "rss_before_load_mib": before / 2**20,
        "peak_rss_load_mib": max(sampler.rss) / 2**20,
        "vm_hwm_mib": hwm / 2**20,
        "peak_kv_used_mib": max(sampler.kv_used, default=0.0) / 2**20,
        "rss_after_load_by_kind_mib": breakdown,
        "rss_samples_mib": [r / 2**20 for r in sampler.rss],
        "requests_completed": summary["requests_completed"],
        "errors": summary["errors"],
        "output_token_throughput": summary["output_token_throughput"],
    }


async def _run(url: str, specs: list, load: Load) -> tuple[list, float, int]:
    limits = httpx.Limits(max_connections=load.concurrency + 2, max_keepalive_connections=load.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(load.timeout)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await run_load(client, specs, model, load)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-contexts", type=int, default=8)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--configs", default="glibc,default", help=f"comma-separated: {', '.join(CONFIGS)}")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    contexts = build_contexts(load_tokenizer("default"), args.num_contexts, args.context_tokens)
    weights = weights_bytes()
    bound = 1.1 * (KV_BUDGET + weights + LRU_BYTES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            print(f"==> {name}: {args.clients} clients on {len(contexts)} stored contexts for {args.duration:g} s")
            rows.append(measure(name, Path(tmp) / "store", contexts, args))
    print(f"\nbound: 1.1 x (KV budget {KV_BUDGET / 2**20:.0f} + weights {weights / 2**20:.0f} "
          f"+ LRU {LRU_BYTES / 2**20:.0f}) = {bound / 2**20:.0f} MiB")  # fmt: skip
    print("| config | RSS before load | peak RSS under load | peak / bound | VmHWM | peak KV used | done | tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        r["peak_over_bound"] = r["peak_rss_load_mib"] * 2**20 / bound
        print(f"| {r['config']} | {r['rss_before_load_mib']:.0f} | {r['peak_rss_load_mib']:.0f} "
              f"| {r['peak_over_bound']:.2f} | {r['vm_hwm_mib']:.0f} | {r['peak_kv_used_mib']:.0f} "
              f"| {r['requests_completed']} | {r['output_token_throughput']:.1f} |")  # fmt: skip
    for r in rows:
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["rss_after_load_by_kind_mib"].items()))
        print(f"{r['config']}, resident MiB after the load by kind: {kinds}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "weights_bytes": weights,
                                    "bound_bytes": bound, "rows": rows}, indent=2))  # fmt: skip
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
