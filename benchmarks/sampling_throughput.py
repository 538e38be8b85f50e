"""Tokens/s under sampling, against greedy, on a running gateway: what sampling costs a batch.

A gateway on a temporary local store serves ``--clients`` closed-loop
streaming clients (short distinct prompts, ``--max-tokens`` with
``ignore_eos``) for ``--duration`` seconds per mix:

- ``greedy`` (temperature 0);
- ``temperature 1.0`` (OpenAI's default);
- ``top_p 0.9`` at temperature 0.7.

The ratio of each mix's tokens/s to greedy's is what sampling costs the step
loop. ``--baseline-repo`` runs the same mixes, in the same run, on a gateway
started from another checkout (an older commit, with ``git worktree add``),
so a change to the sampler is measured side by side. Prints a table, writes
JSON.

    git worktree add /tmp/before <commit>
    python -m benchmarks.sampling_throughput --baseline-repo /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from datetime import datetime
from pathlib import Path

import httpx

from benchmarks.stream_client import Load, run_load, summarize
from benchmarks.workload import RequestSpec, served_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MIXES = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
}


def specs(count: int) -> list[RequestSpec]:
    return [
        RequestSpec(
            i, [{"role": "user", "content": f"Request {i}: write a short story about the number {i}."}], None
        )
        for i in range(count)
    ]


async def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    rows = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        with httpx.Client(base_url=url) as sync:
            model = served_model(sync)
        warm = Load(concurrency=args.clients, requests=args.clients, duration=60, max_tokens=8)
        await run_load(client, specs(args.clients), model, warm)
        for name, mix in MIXES.items():
            load = Load(args.clients, 100_000, args.duration, args.max_tokens, **mix)
            records, duration, peak = await run_load(client, specs(100_000), model, load)
            summary = summarize(records, len(records), duration, peak)
            rows[name] = round(summary["output_token_throughput"], 1)
            print(f"  {name:<16} {rows[name]:>7.1f} tok/s", flush=True)
    return rows


def run_build(repo: Path, args: argparse.Namespace) -> dict[str, float]:
    from tests.gateway_process import GatewayProcess

    with tempfile.TemporaryDirectory() as tmp:
        env = {"CACHEGEN_STORE": f"file://{tmp}/store", "CACHEGEN_MAX_QUEUE": "64"}
        with GatewayProcess(env, Path(tmp) / "gateway.log", repo=repo) as gateway:
            return asyncio.run(measure(gateway.url, args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--baseline-repo", type=Path, help="a checkout to measure the same way, first")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sampling_throughput.json")
    args = p.parse_args()
    builds = {}
    if args.baseline_repo:
        print(f"baseline: {args.baseline_repo}")
        builds["baseline"] = run_build(args.baseline_repo.resolve(), args)
    print("this checkout:")
    builds["this checkout"] = run_build(Path(__file__).resolve().parents[1], args)
    print(f"\n| build | {' | '.join(MIXES)} | " + " | ".join(f"{m} / greedy" for m in list(MIXES)[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(MIXES) - 1))
    for build, rows in builds.items():
        ratios = [rows[m] / rows["greedy"] for m in list(MIXES)[1:]]
        print(
            f"| {build} | "
            + " | ".join(str(rows[m]) for m in MIXES)
            + " | "
            + " | ".join(f"{r:.2f}" for r in ratios)
            + " |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "when": datetime.now().isoformat(timespec="seconds"),
                "clients": args.clients,
                "duration_s": args.duration,
                "max_tokens": args.max_tokens,
                "baseline_repo": str(args.baseline_repo) if args.baseline_repo else None,
                "tokens_per_s": builds,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
