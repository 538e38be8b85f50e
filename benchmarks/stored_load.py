"""Stored contexts loaded by a fresh gateway: this checkout against another revision, one run.

    python -m benchmarks.stored_load --baseline HEAD~1 [--rounds 4] [--warmup-rounds 1]

Issue 16's two load figures, from local disk (the loads read lossless chunks, as ``auto`` picks
there), for each side (the ``--baseline`` revision in a temporary git worktree, then this
checkout), alternating rounds so that drift on a shared machine hits both (after uncounted
warm-up rounds):

* ``stored_fresh_s``: a fresh gateway process, a new question on a stored 3.8K-token context
  (the first 17,000 characters of a licence): TTFT;
* ``stored_2k_alone_s`` and ``stored_2k_worst_of_8_s``: a fresh gateway answers a question on
  one stored 2K context (a warm-up: its first load's one-time costs), then one on another alone,
  then 8 at once, each on a context of its own; the worst of the 8 against the one alone.

The contexts are pre-encoded once, by this checkout, into one store that both sides read (the
chunk keys and format must therefore be the same on both). TTFT is measured at the client
(streamed, greedy, 8 tokens); beside it, the gateway's own account of the fresh question and
of the worst of the 8 (``kv_cache_info``: ``prompt_ms``, ``load_ms``, ``prefill_ms``). Prints the medians of both sides and their ratio, and writes
``benchmarks/results/stored_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ab import REPO, baseline_worktree, report
from benchmarks.vs_vllm import LICENCE, QUESTIONS, context_messages, gateway_env, stream_chat
from benchmarks.workload import build_contexts, load_tokenizer, pre_encode
from engine.loading import convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess

RESULTS = REPO / "benchmarks" / "results"
CONCURRENT = 8


async def ttft(
    client: httpx.AsyncClient, url: str, text: str, question: str, info: dict | None = None
) -> float:
    """TTFT at the client; ``info``, where given, gets the gateway's ``kv_cache_info``."""
    return (await stream_chat(client, url, context_messages(text, question), 8, kv_info=info))[0]


def server_side(info: dict) -> dict[str, Any] | None:
    """Where the gateway says a prompt's time went: arrival to first-token logits (``prompt_ms``),
    lookup, fetch and decode (``load_ms``), and the prefill on top (``prefill_ms``), with how many
    chunks came at each level (``levels``: a store whose pages are no longer in memory is read
    from disk, and the planner then takes smaller levels); None from a baseline whose
    ``kv_cache_info`` has no timings."""
    if "prompt_ms" not in info:
        return None
    levels = Counter(chunk.get("level") or chunk.get("source") for chunk in info.get("chunks", []))
    return {**{k: info[k] for k in ("prompt_ms", "load_ms", "prefill_ms")}, "levels": dict(levels)}


def store_contexts(env: dict[str, str], texts: list[str], log: Path, repo: Path = REPO) -> None:
    with GatewayProcess(env, log, repo=repo) as g, httpx.Client(base_url=g.url, timeout=900) as client:
        pre_encode(client, texts, None)


def set_page_cache(store: Path, state: str) -> None:
    """Put the store's files in the page cache state the fresh question is asked in: ``evicted``
    (``posix_fadvise(DONTNEED)``: read from the disk again, as after a reboot or once this VM's
    DAMON pageout has taken them), ``hot`` (read once, so they are in memory) or ``as-is``."""
    if state == "as-is":
        return
    for path in store.rglob("*"):
        if not path.is_file():
            continue
        if state == "hot":
            path.read_bytes()
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_side(
    repo: Path, env: dict[str, str], long_text: str, texts: list[str], log: Path, page_cache: str = "as-is"
) -> dict[str, Any]:
    fresh_info: dict = {}
    with GatewayProcess(env, log, repo=repo) as g:
        set_page_cache(Path(env["CACHEGEN_STORE"].removeprefix("file://")), page_cache)
        fresh = asyncio.run(_one(g.url, long_text, QUESTIONS[2], fresh_info))
    infos: list[dict] = [{} for _ in texts[2:]]
    with GatewayProcess(env, log, repo=repo) as g:

        async def stored_2k() -> tuple[float, list[float]]:
            async with httpx.AsyncClient() as client:
                await ttft(client, g.url, texts[0], QUESTIONS[0])  # warm-up
                alone = await ttft(client, g.url, texts[1], QUESTIONS[0])
                together = await asyncio.gather(
                    *(ttft(client, g.url, t, QUESTIONS[0], i) for t, i in zip(texts[2:], infos))
                )
            return alone, list(together)

        alone, together = asyncio.run(stored_2k())
    worst = max(range(len(together)), key=together.__getitem__)
    return {
        "stored_fresh_s": round(fresh, 3),
        "stored_fresh_server_ms": server_side(fresh_info),
        "stored_2k_alone_s": round(alone, 3),
        f"stored_2k_worst_of_{CONCURRENT}_s": round(together[worst], 3),
        "stored_2k_together_s": [round(t, 3) for t in together],
        "stored_2k_worst_server_ms": server_side(infos[worst]),
    }


async def _one(url: str, text: str, question: str, info: dict) -> float:
    async with httpx.AsyncClient() as client:
        return await ttft(client, url, text, question, info)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the git revision to compare against")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument(
        "--warmup-rounds", type=int, default=1,
        help="rounds run first and not counted: the first gateways after the encode ran 1.5-3x slower on both sides",
    )  # fmt: skip
    p.add_argument(
        "--page-cache", choices=("as-is", "evicted", "hot"), default="as-is",
        help="the store's files before the fresh question: left as they are, dropped from the page cache, or read into it",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "stored_load.json")
    args = p.parse_args()
    model = convert_default_model(default_cache_dir())
    root = Path(tempfile.mkdtemp(prefix="stored_load-"))
    long_text = LICENCE.read_text()[:17000]
    texts = build_contexts(load_tokenizer("default"), CONCURRENT + 2, 2048)
    sides: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    with baseline_worktree(args.baseline, root) as worktree:
        repos = {"baseline": worktree, "this": REPO}
        # a store per side, encoded by that side's code: the two may write different layouts
        envs = {name: gateway_env(model, "float32", root / f"store-{name}") for name in repos}
        for name, repo in repos.items():
            store_contexts(envs[name], [long_text, *texts], root / f"encode-{name}.log", repo)
        for r in range(args.warmup_rounds + args.rounds):
            for name, repo in repos.items():
                result = run_side(
                    repo, envs[name], long_text, texts, root / f"{name}-{r}.log", args.page_cache
                )
                counted = r >= args.warmup_rounds
                if counted:
                    sides[name].append(result)
                print(name, "" if counted else "(warm-up)", json.dumps(result), flush=True)
    keys = ("stored_fresh_s", "stored_2k_alone_s", f"stored_2k_worst_of_{CONCURRENT}_s")
    summary = {
        name: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys} for name, rs in sides.items()
    }
    for s in summary.values():
        s["worst_over_alone"] = round(s[keys[2]] / s[keys[1]], 2)
    # the gateway's own account of each side's TTFTs, medians over the rounds
    server: dict[str, dict[str, dict[str, float]]] = {name: {} for name in sides}
    for name, rounds in sides.items():
        for key in ("stored_fresh_server_ms", "stored_2k_worst_server_ms"):
            timed = [r[key] for r in rounds if r[key]]
            if timed:
                times = [k for k in timed[0] if k != "levels"]
                server[name][key] = {k: round(statistics.median(t[k] for t in timed), 1) for k in times}
    for name, timings in server.items():
        for key, ms in timings.items():
            print(name, key, " ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    report(
        args.out,
        args.baseline,
        sides,
        summary,
        extra={"server_medians_ms": server, "page_cache": args.page_cache},
    )


if __name__ == "__main__":
    main()
