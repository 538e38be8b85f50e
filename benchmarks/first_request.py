"""A fresh gateway's first chat request: this checkout against another revision (or setting).

    python -m benchmarks.first_request --baseline HEAD~1 [--rounds 5]

Per side and round, a fresh gateway on an empty local store; the client probes ``/health`` on
its connection (as a load balancer would have before sending traffic), then streams one short
chat (2 tokens, greedy). Recorded: the TTFT at the client, the gateway's ``prompt_ms`` (arrival to
the first token's logits) and ``prefill_ms``, and ``after_logits_ms``, the TTFT less
``prompt_ms``: what the HTTP layer, the sampler and the stream add. The sides alternate, each
first in turn. Prints the medians and their ratios; writes
``benchmarks/results/first_request.json``.

What a first request pays that later ones do not is start-up work left undone: the warm-ups of
``app/build.py`` and ``ModelRunner.warm_up`` are there to take it.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ab import REPO, add_baseline_arguments, alternate, medians, parse_env, report, side_repos
from benchmarks.vs_vllm import gateway_env, stream_chat
from engine.loading import convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess

RESULTS = REPO / "benchmarks" / "results"


async def first_chat(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        (await client.get(f"{url}/health")).raise_for_status()
        info: dict = {}
        messages = [{"role": "user", "content": "Hi there"}]
        ttft = (await stream_chat(client, url, messages, 2, kv_info=info))[0] * 1000
    return {
        "ttft_ms": round(ttft, 1),
        "prompt_ms": info["prompt_ms"],
        "prefill_ms": info["prefill_ms"],
        "after_logits_ms": round(ttft - info["prompt_ms"], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_baseline_arguments(p)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=RESULTS / "first_request.json")
    args = p.parse_args()
    model = convert_default_model(default_cache_dir())
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        root = Path(tmp)
        repos = side_repos(args, root, stack)
        env = gateway_env(model, "float32", root / "store")

        def run(name: str, settings: dict[str, str], r: int) -> dict[str, Any]:
            with GatewayProcess({**env, **settings}, root / f"{name}-{r}.log", repo=repos[name]) as g:
                return asyncio.run(first_chat(g.url))

        # as in benchmarks.setting_ab: with --baseline, both sides run with --env's settings
        sides = alternate(
            {"baseline": parse_env(args.baseline_env or args.env), "this": parse_env(args.env)},
            args.rounds,
            run,
        )
    report(args.out, args.baseline or " ".join(args.baseline_env), sides, medians(sides))


if __name__ == "__main__":
    main()
