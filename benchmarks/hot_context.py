"""New questions on a context hot in memory: this checkout against another revision, one run.

    python -m benchmarks.hot_context --baseline 0278ff8 [--rounds 2]

For each round, and for each side (the ``--baseline`` revision, checked out into a temporary git
worktree, then this checkout), a fresh gateway on a fresh local store gets:

* the first 17,000 characters of a licence as the system message with a first question (cold:
  a full prefill; its KV then stays in the memory prefix cache);
* 4 new questions on that context, one after the other (``new_question_s``);
* 4 more at once (``concurrent_new_questions_s``): each request reads the context while the
  others do.

TTFT is measured at the client (streamed, greedy, 8 tokens). Prints the medians of both sides
and their ratio, and writes ``benchmarks/results/hot_context.json``. Written to measure memory
hits that are shared where they lie against hits copied into each request's buffer
(``docs/serving.md``, "The prefix cache of computed KV").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import httpx

from benchmarks.ab import REPO, baseline_worktree, report
from benchmarks.vs_vllm import LICENCE, context_messages, stream_chat
from engine.loading import DEFAULT_MODEL_NAME, convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess

RESULTS = REPO / "benchmarks" / "results"
QUESTIONS = [f"Question {i}: what does section {i} of this licence say?" for i in range(8)]


async def workload(url: str, text: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        cold = (await stream_chat(client, url, context_messages(text, "What is this licence about?"), 8))[0]
        one_by_one = [
            (await stream_chat(client, url, context_messages(text, q), 8))[0] for q in QUESTIONS[:4]
        ]
        together = await asyncio.gather(
            *(stream_chat(client, url, context_messages(text, q), 8) for q in QUESTIONS[4:])
        )
    return {
        "cold_s": round(cold, 3),
        "new_question_s": [round(t, 3) for t in one_by_one],
        "concurrent_new_questions_s": [round(t[0], 3) for t in together],
    }


def run_side(repo: Path, model: Path, text: str, root: Path, name: str) -> dict[str, Any]:
    env = {"CACHEGEN_MODEL": str(model), "CACHEGEN_SERVED_MODEL_NAME": DEFAULT_MODEL_NAME,
           "CACHEGEN_STORE": f"file://{root / name / 'store'}"}  # fmt: skip
    (root / name).mkdir(parents=True, exist_ok=True)
    with GatewayProcess(env, root / name / "gateway.log", repo=repo) as g:
        return asyncio.run(workload(g.url, text))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the git revision to compare against")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "hot_context.json")
    args = p.parse_args()
    text = LICENCE.read_text()[:17000]
    model = convert_default_model(default_cache_dir())
    root = Path(tempfile.mkdtemp(prefix="hot_context-"))
    sides: dict[str, list[dict[str, Any]]] = {"baseline": [], "this": []}
    with baseline_worktree(args.baseline, root) as worktree:
        for r in range(args.rounds):  # alternating, so drift on a shared machine hits both
            for name, repo in (("baseline", worktree), ("this", REPO)):
                result = run_side(repo, model, text, root, f"{name}-{r}")
                sides[name].append(result)
                print(name, json.dumps(result), flush=True)
    summary: dict[str, dict[str, float]] = {}
    for name, results in sides.items():
        summary[name] = {
            key: round(statistics.median(t for r in results for t in r[key]), 3)
            for key in ("new_question_s", "concurrent_new_questions_s")
        }
        summary[name]["concurrent_max_s"] = max(t for r in results for t in r["concurrent_new_questions_s"])
    report(args.out, args.baseline, sides, summary)

if __name__ == "__main__":
    main()
