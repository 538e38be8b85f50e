"""Predict scale-out from measured per-replica costs: 1-64 replicas, 10-10,000 contexts, two policies.

    python -m benchmarks.scaleout_sim [--measured benchmarks/results/scaleout.json]
                                      [--out benchmarks/results/scaleout_sim.json]

Two replicas on a 2-core machine cannot show throughput scaling, so this is a discrete-event
model fed with what ``benchmarks/scaleout.py`` measured on one replica (its ``costs``):

- **A replica** runs two threads, as the measured gateways did (``CACHEGEN_TORCH_THREADS=1``):
  the step loop and the codec. The step loop runs one step at a time: a step holds a token of
  every decoding sequence (n of them cost ``n**beta`` solo steps; beta from the measured decode
  time per token at batch 1 and 2) and the prefill of every prompt ready when it began, so a
  prompt that arrives mid-step waits for the next one. The store hits decoding their fetched
  chunks share the codec thread (the codec gate) in equal parts.
- **A request** first spends the measured per-request overhead (HTTP, tokenization, planning:
  a memory hit's TTFT less its prefill step) and, under ``cache_aware``, what routing adds
  (vllm-router renders every request on every worker first; both measured by ``scaleout``).
  Then its prompt is a memory hit (the replica's prefix cache holds the context: one prefill
  step, whose cost is a line through the measured step on the shortest and the longest context)
  or a store hit: an S3 fetch of the context's bytes (the measured per-stream rate, shared
  under ``--s3-gbps`` over all replicas), then the decode of those bytes into KV on the codec
  thread (the measured ``store_decode_s``, per token), then the question's prefill step (the
  rest of the measured store-hit TTFT, per token). A replica's first store hit also pays the
  measured start-up of a fresh process. The prefill step gives the first token;
  ``max_tokens - 1`` decode steps follow.
- **Memory** is each replica's KV budget as an LRU over contexts (a loaded context stays in the
  prefix cache). As in the gateway, a request on a context in memory attaches its KV rather
  than copying it (its own few tokens are left out), and a context that running requests read
  is not evicted. A store hit reserves its KV, and the staging its load holds for fetched
  chunks, when its fetch starts, evicting what no running request reads; when what running
  requests read leaves too little room, it waits for memory, as the gateway's reservation does.
- **The router**: ``round_robin`` in turn; ``cache_aware`` as vllm-router decides: the replica a
  context was last routed to (its prefix tree), unless the in-flight counts are imbalanced
  (difference > 64 and ratio > 1.5), and the least loaded replica for a context never seen.
- **Clients** are closed-loop, ``--clients-per-replica`` per replica, contexts drawn Zipf-like.

It first replays the measured setting (2 replicas, the measured contexts and clients, both
policies, the requests' contexts in the measured order), and prints how far each figure is from
the measurement. There the two replicas shared one 2-core host with each other, the S3 server,
the router and the clients: their threads share the cores the others left (measured over the
run), at the co-located costs (two replicas decoding at once, each on a core, against one
alone). The grid gives each replica a machine of its own and uses the solo costs. What it
leaves out: the CPU the router's renders take on every worker, recompute of contexts the store
lacks, and the prefix tree's eviction.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile
from benchmarks.workload import zipf_draws

REPLICAS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_COUNTS = (10, 100, 1000, 10_000)
POLICIES = ("cache_aware", "round_robin")


@dataclass
class Costs:
    """Per-replica costs, from ``benchmarks/scaleout.py``'s ``costs``."""

    memory_hit_s_per_token: float  # a memory hit's prefill step (the question over its context), CPU, per token
    store_decode_s_per_token: float  # a store hit's decode of fetched chunks into KV, CPU (prepare threads)
    store_cpu_s_per_token: float  # a store hit's prefill step after its load (the question), CPU
    store_bytes_per_token: float
    s3_stream_bytes_per_s: float  # one fetch, alone
    decode_s_per_token: float  # one sequence, batch 1
    beta: float  # a step of n decodes costs n**beta solo steps
    kv_bytes_per_token: int
    colocated_slowdown: float  # the measuring host: CPU work runs this much slower with both replicas busy
    request_overhead_s: float = 0.0  # a request's time outside the step loop: HTTP, tokenization, planning
    router_overhead_s: float = 0.0  # what cache_aware routing adds (vllm-router renders on every worker)
    load_staging_tokens: int = 0  # KV memory a store hit's load holds for its fetched chunks, in tokens
    memory_hit_s: float = 0.0  # and the part of that step that does not grow with the context
    first_load_extra_s: float = 0.0  # a fresh replica's first store hit: its start-up, CPU

    def memory_hit_step(self, tokens: int) -> float:
        return self.memory_hit_s + tokens * self.memory_hit_s_per_token

    @classmethod
    def from_measured(cls, m: dict[str, Any]) -> Costs:
        tokens = m["context_tokens"]
        d1, d2 = m["decode_s_per_token_batch1"], m["decode_s_per_token_batch2"]
        # runs before the split was measured (run 8) count a memory hit's whole TTFT as its step
        overhead = m.get("request_overhead_s", 0.0)
        store_prefill = m["store_hit_ttft_s"] - m["store_fetch_s"] - m["store_decode_s"] - overhead
        # a memory hit's step: a line through its cost on the shortest and the longest context
        # (runs before those were measured, through 0)
        step = m.get("memory_hit_step_s", m["memory_hit_ttft_s"])
        per_token, fixed = step / tokens, 0.0
        if "memory_hit_step_long_s" in m:
            per_token = max(0.0, (m["memory_hit_step_long_s"] - step) / (m["long_context_tokens"] - tokens))
            fixed = max(0.0, step - per_token * tokens)
        return cls(
            memory_hit_s_per_token=per_token,
            memory_hit_s=fixed,
            store_decode_s_per_token=m["store_decode_s"] / tokens,
            store_cpu_s_per_token=max(store_prefill, 0.0) / tokens,
            store_bytes_per_token=m["store_bytes"] / tokens,
            s3_stream_bytes_per_s=m["store_bytes"] / max(m["store_fetch_s"], 1e-6),
            decode_s_per_token=d1,
            beta=min(1.0, max(0.0, math.log2(max(d2, 1e-9) / d1))),
            kv_bytes_per_token=m["kv_bytes_per_token"],
            colocated_slowdown=m["colocated_slowdown"],
            request_overhead_s=overhead,
            router_overhead_s=m.get("router_overhead_s", 0.0),
            load_staging_tokens=m.get("load_staging_tokens", 0),  # none before run 9
            first_load_extra_s=m.get("first_store_hit_extra_s", 0.0),
        )

    def colocated(self) -> Costs:
        """These costs where replicas share a host, beyond waiting for a core (which the
        simulation models): the measured slowdown of two replicas decoding at once, each on a
        core, against one alone (memory bandwidth and caches). The request overhead is the
        gateway's own CPU work too, and slows alike."""
        f = self.colocated_slowdown
        return dataclasses.replace(
            self,
            memory_hit_s_per_token=self.memory_hit_s_per_token * f,
            memory_hit_s=self.memory_hit_s * f,
            store_decode_s_per_token=self.store_decode_s_per_token * f,
            store_cpu_s_per_token=self.store_cpu_s_per_token * f,
            decode_s_per_token=self.decode_s_per_token * f,
            request_overhead_s=self.request_overhead_s * f,
            first_load_extra_s=self.first_load_extra_s * f,
        )


@dataclass(eq=False)
class Job:
    client: int
    context: int
    tokens: int  # the context's
    started: float
    replica: int
    hot: bool = False
    # route (a delay: the router, HTTP, tokenization) -> fetch (S3; store hits) -> load (CPU, the
    # prepare threads; store hits) -> prompt (its prefill, one step) -> decode (a token a step)
    phase: str = "route"
    remaining: float = 0.0  # seconds (route), bytes (fetch), CPU seconds at solo speed (load, prompt)
    tokens_left: int = 0  # decode
    ttft: float | None = None
    counted: bool = True  # issued after the warm-up


@dataclass
class Replica:
    """Two threads, as the measured gateways ran: the step loop (torch, one thread) and the codec
    (numba, one thread), which the store hits decoding their fetched chunks share in equal parts
    (work that does not batch). The step loop runs one step at a time, as the gateway's does: a
    step holds every decoding sequence (a token each; n of them cost ``n**beta`` solo steps) and
    the prefill of every prompt that was ready when it began. A prompt that arrives while a step
    is in flight waits for the next."""

    capacity_tokens: int
    memory: OrderedDict[int, int] = field(default_factory=OrderedDict)  # context -> tokens, LRU first
    loads: list[Job] = field(default_factory=list)
    ready: list[Job] = field(default_factory=list)  # prompts for the next step
    running: list[Job] = field(default_factory=list)  # decoding
    step: list[Job] = field(default_factory=list)  # the step in flight
    step_left: float = 0.0  # its CPU seconds at solo speed
    in_flight: int = 0
    loaded_before: bool = False  # a fresh process's first store hit pays its start-up
    memory_queue: list[Job] = field(default_factory=list)  # store hits waiting for KV memory

    @property
    def busy_threads(self) -> int:
        return bool(self.step) + bool(self.loads)

    def start_step(self, costs: Costs) -> None:
        if self.step or not (self.ready or self.running):
            return
        n = len(self.running)
        self.step_left = sum(j.remaining for j in self.ready) + (costs.decode_s_per_token * n**costs.beta if n else 0.0)
        self.step = self.ready + self.running
        self.ready = []

    def others(self, job: Job) -> list[Job]:
        prompts = [j for j in self.step if j.phase == "prompt"]
        return [j for j in self.loads + self.ready + self.running + prompts if j is not job]

    def lookup(self, context: int) -> bool:
        if context in self.memory:
            self.memory.move_to_end(context)
            return True
        return False

    def admit(self, context: int, tokens: int, reserved: int, in_use: set[int]) -> None:
        """Keep ``context`` in the prefix cache, evicting the least recently used contexts that no
        running request reads, to fit beside the ``reserved`` KV of store hits still loading."""
        if tokens > self.capacity_tokens - reserved:
            return
        self.memory[context] = tokens
        self.memory.move_to_end(context)
        self.make_room(reserved, in_use | {context})

    def make_room(self, reserved: int, in_use: set[int]) -> None:
        """Evict the least recently used contexts that no running request reads until the cache
        fits beside ``reserved`` tokens, as a request's KV reservation does in the gateway."""
        budget = self.capacity_tokens - reserved
        held = sum(self.memory.values())
        for old in list(self.memory):
            if held <= budget:
                break
            if old not in in_use:
                held -= self.memory.pop(old)


class Router:
    def __init__(self, policy: str, replicas: list[Replica]) -> None:
        self.policy, self.replicas = policy, replicas
        self.turn = 0
        self.tree: dict[int, int] = {}  # context -> the replica it was last routed to

    def pick(self, context: int) -> int:
        loads = [r.in_flight for r in self.replicas]
        if self.policy == "round_robin":
            self.turn += 1
            return (self.turn - 1) % len(self.replicas)
        least = min(range(len(loads)), key=loads.__getitem__)
        imbalanced = max(loads) - min(loads) > 64 and max(loads) > 1.5 * min(loads)
        chosen = least if imbalanced or context not in self.tree else self.tree[context]
        self.tree[context] = chosen
        return chosen


def simulate(
    costs: Costs,
    *,
    replicas: int,
    context_tokens: list[int],
    clients: int,
    policy: str,
    requests: int,
    warmup: int,
    max_tokens: int,
    kv_memory_bytes: int,
    s3_bytes_per_s: float,
    zipf: float,
    seed: int,
    shared_cores: float | None = None,
    draws: list[int] | None = None,
) -> dict[str, float]:
    """``shared_cores``: every replica's threads share that many cores (the measuring host);
    None: each replica has a machine of its own, where its two threads never wait for a core.
    ``draws``: the contexts the requests ask about, in the order clients send them (default:
    Zipf-like draws from ``seed``)."""
    rng = random.Random(seed)
    n_ctx = len(context_tokens)
    cum = list(_cumulative([1.0 / (k + 1) ** zipf for k in range(n_ctx)]))
    pool = [Replica(kv_memory_bytes // costs.kv_bytes_per_token) for _ in range(replicas)]
    router = Router(policy, pool)
    # round_robin's router only forwards; cache_aware first renders the request on every worker
    route_s = costs.request_overhead_s + (costs.router_overhead_s if policy == "cache_aware" else 0.0)
    routing: list[Job] = []
    fetching: list[Job] = []
    done: list[Job] = []
    issued = 0
    now = 0.0
    bytes_fetched = 0.0
    counted_start: float | None = None
    tokens_after_warmup = 0

    def issue(client: int) -> None:
        nonlocal issued
        k = draws[issued] if draws is not None else _draw(cum, rng)
        issued += 1
        r = router.pick(k)
        pool[r].in_flight += 1
        routing.append(Job(client, k, context_tokens[k], now, r, remaining=route_s, counted=issued > warmup))

    def arrive(job: Job) -> None:
        rep = pool[job.replica]
        job.hot = rep.lookup(job.context)
        if job.hot:
            job.phase, job.remaining = "prompt", costs.memory_hit_step(job.tokens)
            rep.ready.append(job)
        else:
            job.phase = "wait"
            rep.memory_queue.append(job)
            reserve_memory(rep)

    def reserve_memory(rep: Replica) -> None:
        """Start the fetches of store hits whose KV and staging fit beside what running requests
        read and what other loads reserved, in arrival order, making room by evicting the rest;
        the others wait, as a request's KV reservation does in the gateway. With nothing else on
        the replica a request goes ahead whatever it needs."""
        nonlocal bytes_fetched
        while rep.memory_queue:
            job = rep.memory_queue[0]
            others = on_replica(job)
            need = reserved(others) + job.tokens + costs.load_staging_tokens
            in_use = {j.context for j in others}
            pinned = sum(t for c, t in rep.memory.items() if c in in_use)
            if others and pinned + need > rep.capacity_tokens:
                return
            rep.memory_queue.pop(0)
            rep.make_room(need, in_use)
            job.phase, job.remaining = "fetch", job.tokens * costs.store_bytes_per_token
            if job.counted:
                bytes_fetched += job.remaining
            fetching.append(job)

    def on_replica(job: Job) -> list[Job]:
        return pool[job.replica].others(job) + [j for j in fetching if j.replica == job.replica and j is not job]

    def reserved(jobs: list[Job]) -> int:
        """The KV memory that store hits among ``jobs`` hold while they load, in tokens."""
        loading = sum(j.tokens for j in jobs if not j.hot and j.phase != "decode")
        return loading + costs.load_staging_tokens * sum(j.phase in ("fetch", "load") for j in jobs)

    def finish(job: Job) -> None:
        nonlocal counted_start, tokens_after_warmup
        pool[job.replica].in_flight -= 1
        done.append(job)
        reserve_memory(pool[job.replica])  # what it read may be evicted now
        if len(done) == warmup:
            counted_start = now
        if len(done) > warmup:
            tokens_after_warmup += max_tokens
        if issued < requests + warmup:
            issue(job.client)

    def end_step(rep: Replica) -> None:
        finished, rep.step = rep.step, []
        for job in finished:
            if job.phase == "prompt":  # its prefill step gave the first token
                job.ttft = now - job.started
                others = on_replica(job)
                rep.admit(job.context, job.tokens, reserved(others), {j.context for j in others})
                job.phase, job.tokens_left = "decode", max_tokens - 1
                if job.tokens_left > 0:
                    rep.running.append(job)
                else:
                    finish(job)
            else:
                job.tokens_left -= 1
                if job.tokens_left == 0:
                    rep.running.remove(job)
                    finish(job)

    for c in range(clients):
        issue(c)
    eps = 1e-12
    while len(done) < requests + warmup:
        for rep in pool:
            rep.start_step(costs)
        # the next event: a request reaching its replica, a fetch, a load or a step ending
        fetch_rate = min(costs.s3_stream_bytes_per_s, s3_bytes_per_s / len(fetching)) if fetching else 0.0
        thread = 1.0  # how fast a busy thread runs against a core of its own
        if shared_cores is not None:
            thread = min(1.0, shared_cores / max(1, sum(rep.busy_threads for rep in pool)))
        dt = min((j.remaining for j in routing), default=math.inf)
        for job in fetching:
            dt = min(dt, job.remaining / fetch_rate)
        for rep in pool:
            for j in rep.loads:
                dt = min(dt, j.remaining * len(rep.loads) / thread)
            if rep.step:
                dt = min(dt, rep.step_left / thread)
        now += dt
        for job in routing:
            job.remaining -= dt
        for job in fetching:
            job.remaining -= dt * fetch_rate
        for rep in pool:
            n_loads = len(rep.loads)
            for j in rep.loads:
                j.remaining -= dt * thread / n_loads
            if rep.step:
                rep.step_left -= dt * thread
        for job in [j for j in routing if j.remaining <= eps]:
            routing.remove(job)
            arrive(job)
        for job in [f for f in fetching if f.remaining <= eps]:
            fetching.remove(job)
            rep = pool[job.replica]
            job.phase, job.remaining = "load", job.tokens * costs.store_decode_s_per_token
            if not rep.loaded_before:
                job.remaining += costs.first_load_extra_s
                rep.loaded_before = True
            rep.loads.append(job)
        for rep in pool:
            for job in [j for j in rep.loads if j.remaining <= eps]:
                rep.loads.remove(job)  # its KV is in memory: the question's prefill is a step-loop job
                job.phase, job.remaining = "prompt", job.tokens * costs.store_cpu_s_per_token
                rep.ready.append(job)
            if rep.step and rep.step_left <= eps:
                end_step(rep)
    counted = done[warmup:]
    ttfts = [j.ttft for j in counted]
    return {
        "memory_hot_share": sum(j.hot for j in counted) / len(counted),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tokens_per_s": tokens_after_warmup / (now - (counted_start or 0.0)),
        "s3_bytes_per_request": bytes_fetched / max(1, issued - warmup),
    }


def _cumulative(weights: list[float]):
    total, acc = sum(weights), 0.0
    for w in weights:
        acc += w / total
        yield acc


def _draw(cum: list[float], rng: random.Random) -> int:
    return min(bisect.bisect_left(cum, rng.random()), len(cum) - 1)


def replay(costs: Costs, measured: dict[str, Any], s3: float) -> list[dict[str, Any]]:
    """The measured setting, simulated: per policy, the simulation beside the measurement, and
    the relative error of each figure. The requests ask about the contexts the measured run's
    clients asked about, in the same order (with 128 requests, the draws alone move the
    simulated hot share by +-0.06 and round_robin's TTFT p50 between 0.34 and 0.88 s). The two
    replicas shared one host's cores there, with each other and with the S3 server, the router
    and the clients: the replicas' threads share the cores those others left over the run
    (``host_cpu``, measured), and run at the co-located costs (``Costs.colocated``)."""
    args = measured["args"]
    tokens = [c["tokens"] for c in measured["contexts"]]
    draws = zipf_draws(len(tokens), args["requests"], args["zipf"], args["seed"])
    host = costs.colocated()
    rows = []
    for run in measured["runs"]:
        cpu = run["host_cpu"]
        cores = max(0.5, cpu["cores"] - cpu["others_s"] / run["wall_s"])
        sim = simulate(
            host, replicas=2, context_tokens=tokens, clients=args["clients"], policy=run["policy"],
            requests=args["requests"], warmup=0, max_tokens=args["max_tokens"],
            kv_memory_bytes=args["kv_memory_mb"] * 2**20, s3_bytes_per_s=s3, zipf=args["zipf"], seed=0,
            shared_cores=cores, draws=draws,
        )  # fmt: skip
        row: dict[str, Any] = {"policy": run["policy"], "shared_cores": cores}
        for key in ("memory_hot_share", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "s3_bytes_per_request"):
            row[key] = {
                "measured": run[key],
                "simulated": sim[key],
                "error": (sim[key] - run[key]) / run[key] if run[key] else None,
            }
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measured", type=Path, default=Path("benchmarks/results/scaleout.json"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scaleout_sim.json"))
    p.add_argument("--s3-gbps", type=float, default=10.0, help="the store's aggregate throughput")
    p.add_argument("--clients-per-replica", type=int, default=2)
    p.add_argument("--kv-memory-gb", type=float, default=None, help="default: the measured run's")
    p.add_argument("--requests", type=int, default=3000)
    args = p.parse_args()
    measured = json.loads(args.measured.read_text())
    costs = Costs.from_measured(measured["costs"])
    s3 = args.s3_gbps * 1e9 / 8
    margs = measured["args"]
    kv_memory = int((args.kv_memory_gb * 2**30) if args.kv_memory_gb else margs["kv_memory_mb"] * 2**20)

    check = replay(costs, measured, s3)
    print(f"costs: {json.dumps(vars(costs))}")
    print(f"\nreplay of the measured run (2 replicas, {margs['clients']} clients, {margs['requests']} requests):")
    print(f"{'policy':<12} {'figure':<22} {'measured':>10} {'simulated':>10} {'error':>7}")
    for row in check:
        for key, v in row.items():
            if isinstance(v, dict):
                err = "" if v["error"] is None else f"{v['error']:+.0%}"
                print(f"{row['policy']:<12} {key:<22} {v['measured']:>10.3f} {v['simulated']:>10.3f} {err:>7}")

    lo, hi = margs["min_tokens"], margs["max_tokens_context"]
    grid = []
    for n_ctx in CONTEXT_COUNTS:
        tokens = [random.Random(n_ctx).randint(lo, hi) for _ in range(n_ctx)]
        for replicas in REPLICAS:
            for policy in POLICIES:
                clients = args.clients_per_replica * replicas
                result = simulate(
                    costs, replicas=replicas, context_tokens=tokens, clients=clients, policy=policy,
                    requests=args.requests, warmup=args.requests // 2, max_tokens=margs["max_tokens"],
                    kv_memory_bytes=kv_memory, s3_bytes_per_s=s3, zipf=margs["zipf"], seed=0,
                )  # fmt: skip
                grid.append({"contexts": n_ctx, "replicas": replicas, "clients": clients, "policy": policy, **result})
    print(f"\n{'contexts':>8} {'replicas':>8} {'policy':<12} {'hot':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>8}")
    for g in grid:
        print(
            f"{g['contexts']:>8} {g['replicas']:>8} {g['policy']:<12} {g['memory_hot_share']:>5.2f} "
            f"{g['ttft_p50_s']:>8.3f}s {g['ttft_p99_s']:>8.3f}s {g['tokens_per_s']:>8.1f}"
        )
    report = {
        "benchmark": "scaleout_sim",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "measured_from": str(args.measured),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "costs": vars(costs),
        "replay": check,
        "grid": grid,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
