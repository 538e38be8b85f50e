"""A fresh gateway's first stored questions after a cold numba cache, another revision against this one.

    git worktree add /tmp/wt_head a93bacd
    python -m benchmarks.cold_first_request --store DIR --baseline-tree /tmp/wt_head \\
        --out benchmarks/results/numba_cold_first_request.json

``DIR`` holds a store (``DIR/stored``) with the 17,000-character licence context pre-encoded (as
``benchmarks.vs_vllm`` leaves it). Per side and round: numba's cache files of that tree removed,
then two fresh gateways in turn, each asked a question at ``kv_quality`` ``medium`` (lossy chunks,
decoded into the request's KV buffer) and one at ``high``: the request times (2 tokens).
"""

import argparse
import glob
import json
import os
import time
from pathlib import Path

import httpx

from benchmarks.vs_vllm import LICENCE, QUESTIONS, context_messages, gateway_env
from engine.loading import DEFAULT_MODEL_NAME, convert_default_model, default_cache_dir
from tests.gateway_process import GatewayProcess

p = argparse.ArgumentParser()
p.add_argument("--store", type=Path, required=True)
p.add_argument("--baseline-tree", type=Path, required=True)
p.add_argument("--out", type=Path, required=True)
args = p.parse_args()
store = args.store
model = convert_default_model(default_cache_dir())
text = LICENCE.read_text()[:17000]
env = gateway_env(model, "float32", store / "stored")
results = {}
for name, repo in (("baseline", args.baseline_tree), ("this", Path(__file__).resolve().parents[1])) * 2:
    for f in glob.glob(str(repo / "codec/__pycache__/*.nb*")) + glob.glob(
        str(repo / "engine/__pycache__/*.nb*")
    ):
        os.remove(f)
    row = []
    for i in range(2):
        t0 = time.perf_counter()
        with GatewayProcess(env, store / f"cold-{name}-{i}.log", repo=repo) as g:
            start = time.perf_counter() - t0
            ttfts = []
            for q, quality in ((QUESTIONS[2], "medium"), (QUESTIONS[1], "high")):
                t = time.perf_counter()
                r = httpx.post(
                    f"{g.url}/v1/chat/completions",
                    json={
                        "model": DEFAULT_MODEL_NAME,
                        "messages": context_messages(text, q),
                        "max_tokens": 2,
                        "kv_quality": quality,
                    },
                    timeout=900,
                )
                r.raise_for_status()
                ttfts.append(round(time.perf_counter() - t, 3))
        row.append({"startup_s": round(start, 1), "first_s": ttfts[0], "second_s": ttfts[1]})
    results.setdefault(name, []).append(row)
    print(name, row, flush=True)
args.out.write_text(json.dumps(results, indent=1))
