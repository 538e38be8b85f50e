"""Predict scale-out from measured per-replica costs: 1-64 replicas, 10-10,000 contexts, two policies.

    python -m benchmarks.scaleout_sim [--measured benchmarks/results/scaleout.json]
                                      [--out benchmarks/results/scaleout_sim.json]

Two replicas on a 2-core machine cannot show throughput scaling, so this is a discrete-event
model fed with what ``benchmarks/scaleout.py`` measured on one replica (its ``costs``):

- **A replica** is a processor-sharing server over one core: each store hit decoding its
  fetched chunks takes an equal share, and so does the step loop's batch as a whole (decodes
  and prompt prefills), whose step at batch n costs ``n**beta`` solo steps; beta from the measured decode time per token at batch 1 and 2 (beta 1: batching
  gains nothing; 0: a batch costs what one sequence does).
- **A request** is a prompt phase, then ``max_tokens`` decode steps. Its prompt is a memory hit
  (the replica's prefix cache holds the context: the measured memory-hit TTFT, per context
  token, a step-loop job) or a store hit: an S3 fetch of the context's bytes (the measured
  per-stream rate, shared under ``--s3-gbps`` over all replicas), then, as in the gateway, the
  decode of those bytes into KV on the prepare threads (the measured ``store_decode_s``, per
  token; a CPU share of its own), then the question's prefill on the step loop (the rest of the
  measured store-hit TTFT, per token; batched like a memory hit's).
- **Memory** is each replica's KV budget as an LRU over contexts (a loaded context stays in the
  prefix cache). As in the gateway, a request on a context in memory attaches its KV rather
  than copying it (its own few tokens are left out), and a context that running requests read
  is not evicted; a store hit's KV being loaded takes its room first.
- **The router**: ``round_robin`` in turn; ``cache_aware`` as vllm-router decides: the replica a
  context was last routed to (its prefix tree), unless the in-flight counts are imbalanced
  (difference > 64 and ratio > 1.5), and the least loaded replica for a context never seen.
- **Clients** are closed-loop, ``--clients-per-replica`` per replica, contexts drawn Zipf-like.

It first replays the measured setting (2 replicas, the measured contexts and clients, both
policies), averaged over seeds, and prints how far each figure is from the measurement. There
the two replicas shared one 2-core host with each other, the S3 server, the router and the
clients, so the replay slows the CPU costs by what was measured of that: the co-location
factor (both replicas decoding at once against one alone) and the share of the cores the other
processes used over the run. The grid assumes a machine per replica and uses the solo costs. What it leaves out: tokenization and HTTP, the router's own latency, recompute of
contexts the store lacks, and the prefix tree's eviction.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile

REPLICAS = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_COUNTS = (10, 100, 1000, 10_000)
POLICIES = ("cache_aware", "round_robin")


@dataclass
class Costs:
    """Per-replica costs, from ``benchmarks/scaleout.py``'s ``costs``."""

    memory_hit_s_per_token: float  # prompt phase of a memory hit, CPU
    store_decode_s_per_token: float  # a store hit's decode of fetched chunks into KV, CPU (prepare threads)
    store_cpu_s_per_token: float  # the rest of a store hit's prompt (the question's prefill), CPU (the step loop)
    store_bytes_per_token: float
    s3_stream_bytes_per_s: float  # one fetch, alone
    decode_s_per_token: float  # one sequence, batch 1
    beta: float  # batch n runs each sequence at n**-beta of its solo speed
    kv_bytes_per_token: int
    colocated_slowdown: float  # the measuring host: CPU work runs this much slower with both replicas busy

    @classmethod
    def from_measured(cls, m: dict[str, Any]) -> Costs:
        tokens = m["context_tokens"]
        d1, d2 = m["decode_s_per_token_batch1"], m["decode_s_per_token_batch2"]
        return cls(
            memory_hit_s_per_token=m["memory_hit_ttft_s"] / tokens,
            store_decode_s_per_token=m["store_decode_s"] / tokens,
            store_cpu_s_per_token=max(m["store_hit_ttft_s"] - m["store_fetch_s"] - m["store_decode_s"], 0.0) / tokens,
            store_bytes_per_token=m["store_bytes"] / tokens,
            s3_stream_bytes_per_s=m["store_bytes"] / max(m["store_fetch_s"], 1e-6),
            decode_s_per_token=d1,
            beta=min(1.0, max(0.0, math.log2(max(d2, 1e-9) / d1))),
            kv_bytes_per_token=m["kv_bytes_per_token"],
            colocated_slowdown=m["colocated_slowdown"],
        )

    def on_host(self, host_cpu: dict[str, float] | None, wall_s: float, replicas: int) -> Costs:
        """These costs on the measuring host, where the replicas share its cores with each other
        (``colocated_slowdown``) and with the S3 server, the router and the clients: what those
        used of the cores over the run (``host_cpu``, measured) the replicas did not have."""
        f = self.colocated_slowdown
        if host_cpu is not None:
            per_replica = host_cpu["cores"] / replicas
            left = per_replica - host_cpu["others_s"] / wall_s / replicas
            f *= min(per_replica, 1.0) / max(min(left, 1.0), 0.1)
        return dataclasses.replace(
            self,
            memory_hit_s_per_token=self.memory_hit_s_per_token * f,
            store_decode_s_per_token=self.store_decode_s_per_token * f,
            store_cpu_s_per_token=self.store_cpu_s_per_token * f,
            decode_s_per_token=self.decode_s_per_token * f,
        )


@dataclass
class Job:
    client: int
    context: int
    tokens: int  # the context's
    started: float
    replica: int
    hot: bool = False
    phase: str = "fetch"  # fetch (S3, not CPU) -> load (CPU; store hits) -> prompt (CPU) -> decode (CPU)
    remaining: float = 0.0  # bytes in fetch, CPU seconds at solo speed otherwise
    ttft: float | None = None

    @property
    def batched(self) -> bool:
        """In the model's ragged step: decoding, or prefilling the question once its context's KV
        is in memory (attached from the prefix cache, or just loaded), so that the step holds
        only the question's tokens."""
        return self.phase in ("decode", "prompt")


@dataclass
class Replica:
    capacity_tokens: int
    memory: OrderedDict[int, int] = field(default_factory=OrderedDict)  # context -> tokens, LRU first
    cpu: list[Job] = field(default_factory=list)
    in_flight: int = 0

    def speeds(self, beta: float) -> list[float]:
        """How fast each job on the CPU runs against its solo speed. The replica's core is shared,
        in equal parts, by each decode of fetched chunks in progress (work that does not batch)
        and by the step loop's batch as a whole, whose step at batch n costs ``n**beta`` times a
        solo step."""
        batched = sum(j.batched for j in self.cpu)
        shares = len(self.cpu) - batched + (1 if batched else 0)
        return [1.0 / (shares * batched**beta) if j.batched else 1.0 / shares for j in self.cpu]

    def lookup(self, context: int) -> bool:
        if context in self.memory:
            self.memory.move_to_end(context)
            return True
        return False

    def admit(self, context: int, tokens: int, loading_tokens: int, in_use: set[int]) -> None:
        """Keep ``context`` in the prefix cache, evicting the least recently used contexts that no
        running request reads, to fit beside the KV of store hits still loading."""
        budget = self.capacity_tokens - loading_tokens
        if tokens > budget:
            return
        self.memory[context] = tokens
        self.memory.move_to_end(context)
        held = sum(self.memory.values())
        for old in list(self.memory):
            if held <= budget:
                break
            if old not in in_use and old != context:
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
) -> dict[str, float]:
    rng = random.Random(seed)
    n_ctx = len(context_tokens)
    cum = list(_cumulative([1.0 / (k + 1) ** zipf for k in range(n_ctx)]))
    pool = [Replica(kv_memory_bytes // costs.kv_bytes_per_token) for _ in range(replicas)]
    router = Router(policy, pool)
    fetching: list[Job] = []
    done: list[Job] = []
    issued = 0
    now = 0.0
    bytes_fetched = 0.0
    counted_start: float | None = None
    tokens_after_warmup = 0

    def issue(client: int) -> None:
        nonlocal issued, bytes_fetched
        issued += 1
        k = _draw(cum, rng)
        r = router.pick(k)
        rep = pool[r]
        rep.in_flight += 1
        job = Job(client, k, context_tokens[k], now, r, hot=rep.lookup(k))
        if job.hot:
            job.phase, job.remaining = "prompt", job.tokens * costs.memory_hit_s_per_token
            rep.cpu.append(job)
        else:
            job.remaining = job.tokens * costs.store_bytes_per_token
            if issued > warmup:
                bytes_fetched += job.remaining
            fetching.append(job)

    for c in range(clients):
        issue(c)
    while len(done) < requests + warmup:
        # the next event: a fetch or a CPU phase ending
        fetch_rate = min(costs.s3_stream_bytes_per_s, s3_bytes_per_s / len(fetching)) if fetching else 0.0
        dt = math.inf
        for job in fetching:
            dt = min(dt, job.remaining / fetch_rate)
        speeds = [rep.speeds(costs.beta) for rep in pool]
        for rep, rep_speeds in zip(pool, speeds, strict=True):
            for j, speed in zip(rep.cpu, rep_speeds, strict=True):
                dt = min(dt, j.remaining / speed)
        now += dt
        for job in fetching:
            job.remaining -= dt * fetch_rate
        for rep, rep_speeds in zip(pool, speeds, strict=True):
            for j, speed in zip(rep.cpu, rep_speeds, strict=True):
                j.remaining -= dt * speed
        eps = 1e-12
        for job in [f for f in fetching if f.remaining <= eps]:
            fetching.remove(job)
            job.phase, job.remaining = "load", job.tokens * costs.store_decode_s_per_token
            pool[job.replica].cpu.append(job)
        for rep in pool:
            for job in [j for j in rep.cpu if j.remaining <= eps]:
                if job.phase == "load":  # its KV is in memory: the question's prefill is a step-loop job
                    job.phase, job.remaining = "prompt", job.tokens * costs.store_cpu_s_per_token
                    if job.remaining > eps:
                        continue
                if job.phase == "prompt":
                    job.ttft = now - job.started
                    others = [j for j in rep.cpu if j is not job]
                    loading = sum(j.tokens for j in others if j.phase in ("load", "prompt") and not j.hot)
                    rep.admit(job.context, job.tokens, loading, {j.context for j in others})
                    job.phase, job.remaining = "decode", (max_tokens - 1) * costs.decode_s_per_token
                    if job.remaining > eps:
                        continue
                rep.cpu.remove(job)
                rep.in_flight -= 1
                done.append(job)
                if len(done) == warmup:
                    counted_start = now
                if len(done) > warmup:
                    tokens_after_warmup += max_tokens
                if issued < requests + warmup:
                    issue(job.client)
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


def replay(costs: Costs, measured: dict[str, Any], s3: float, seeds: int) -> list[dict[str, Any]]:
    """The measured setting, simulated: per policy, the simulation's mean over seeds beside the
    measurement, and the relative error of each figure. The two replicas shared one host's cores
    there, with the S3 server, the router and the clients: the CPU costs are the host's
    (``Costs.on_host``, from what each run measured)."""
    args = measured["args"]
    tokens = [c["tokens"] for c in measured["contexts"]]
    rows = []
    for run in measured["runs"]:
        host = costs.on_host(run.get("host_cpu"), run["wall_s"], replicas=2)
        sims = [
            simulate(
                host, replicas=2, context_tokens=tokens, clients=args["clients"], policy=run["policy"],
                requests=args["requests"], warmup=0, max_tokens=args["max_tokens"],
                kv_memory_bytes=args["kv_memory_mb"] * 2**20, s3_bytes_per_s=s3, zipf=args["zipf"], seed=seed,
            )  # fmt: skip
            for seed in range(seeds)
        ]
        row: dict[str, Any] = {"policy": run["policy"], "cpu_slowdown": host.decode_s_per_token / costs.decode_s_per_token}
        for key in ("memory_hot_share", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "s3_bytes_per_request"):
            predicted = statistics.fmean(s[key] for s in sims)
            row[key] = {
                "measured": run[key],
                "simulated": predicted,
                "error": (predicted - run[key]) / run[key] if run[key] else None,
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
    p.add_argument("--seeds", type=int, default=20, help="seeds averaged in the replay")
    args = p.parse_args()
    measured = json.loads(args.measured.read_text())
    costs = Costs.from_measured(measured["costs"])
    s3 = args.s3_gbps * 1e9 / 8
    margs = measured["args"]
    kv_memory = int((args.kv_memory_gb * 2**30) if args.kv_memory_gb else margs["kv_memory_mb"] * 2**20)

    check = replay(costs, measured, s3, args.seeds)
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
