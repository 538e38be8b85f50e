"""A lossy level's decode as the gateway runs it: one gateway setting against another, one run.

    python -m benchmarks.gateway_decode --baseline-env CACHEGEN_CODEC_THREADING_LAYER=workqueue
    python -m benchmarks.gateway_decode --baseline HEAD~1 --level low

A stored 3.8K-token context (the first 17,000 characters of a licence), pre-encoded by each side
into a local store of its own, is asked about again and again at ``--level`` for ``--seconds`` in
each gateway, with both memory tiers off so that every request loads and decodes every chunk.
Gateways with the baseline's settings (or the ``--baseline`` revision's code, in a git worktree)
and with this checkout's defaults (plus ``--env``) alternate, each side first in turn. Per side:
the median decode time of a whole chunk (``kv_cache_info``), the question's prefill and the
requests answered; the medians over rounds and their ratios go to the JSON and the table
(``benchmarks/ab.py``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ab import REPO, add_baseline_arguments, alternate, medians, parse_env, report, side_repos
from benchmarks.stored_load import store_contexts
from benchmarks.vs_vllm import DEFAULT_MODEL_NAME, LICENCE, QUESTIONS, context_messages, gateway_env
from engine.loading import convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess


def one_side(
    env: dict[str, str], text: str, args: argparse.Namespace, log: Path, repo: Path = REPO
) -> dict[str, Any]:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "messages": context_messages(text, QUESTIONS[1]),
        "max_tokens": 1,
        "kv_quality": args.level,
    }
    env = env | {"CACHEGEN_PREFIX_CACHE": "0", "CACHEGEN_STORE_CACHE_BYTES": "0"}
    with GatewayProcess(env, log, repo=repo) as g, httpx.Client(base_url=g.url, timeout=600) as client:
        for _ in range(2):  # the process's one-time costs
            client.post("/v1/chat/completions", json=body).raise_for_status()
        decode, prefill, requests = [], [], 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            info = response.json()["kv_cache_info"]
            whole = (c for c in info["chunks"] if c["level"] == args.level and c["tokens"] == 256)
            decode += [c["decode_ms"] for c in whole]
            prefill.append(info["prefill_ms"])
            requests += 1
    return {
        "decode_ms_per_chunk": round(statistics.median(decode), 2),
        "prefill_ms": round(statistics.median(prefill), 1),
        "requests": requests,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_baseline_arguments(p)
    p.add_argument("--level", default="medium")
    p.add_argument("--seconds", type=float, default=10.0, help="of requests per gateway")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gateway_decode.json")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gateway_decode-"))
    model = convert_default_model(default_cache_dir())
    text = LICENCE.read_text()[:17000]
    envs = {  # a store per side: its context's manifest names that side's levels
        name: gateway_env(model, "float32", root / f"store-{name}") | parse_env(settings)
        for name, settings in (("baseline", args.baseline_env or args.env), ("this", args.env))
    }
    with ExitStack() as stack:
        repos = side_repos(args, root, stack)
        for name, side_env in envs.items():
            store_contexts(side_env, [text], root / f"encode-{name}.log", repos[name])  # its own layout
        sides = alternate(
            envs,
            args.rounds,
            lambda name, side_env, r: one_side(side_env, text, args, root / f"{name}-{r}.log", repos[name]),
        )
    report(args.out, args.baseline or " ".join(args.baseline_env), sides, medians(sides))


if __name__ == "__main__":
    main()
