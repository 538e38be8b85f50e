"""The load-test path the README documents: ``benchmarks/prefix_dataset.py`` stores contexts in a
live gateway and writes a dataset, then a real guidellm run (a few requests, goodput under a
TTFT/TPOT SLO) loads the gateway with it, and the gateway's metrics show the stored contexts
were what those requests reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.prefix_dataset import default_tokenizer_dir, tool_command
from tests.conftest import MODEL_NAME
from tests.gateway_process import REPO

pytestmark = pytest.mark.slow

CONTEXTS, QUESTIONS, MAX_TOKENS = 2, 3, 8


def counter(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def run(command: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env["HF_HUB_OFFLINE"] = "1"  # the tokenizer is the built-in model's directory, on disk
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def guidellm_dataset(gateway, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("load") / "prefix.jsonl"
    run([sys.executable, "-m", "benchmarks.prefix_dataset", "--url", gateway.url, "--format", "guidellm",
         "--num-contexts", str(CONTEXTS), "--context-tokens", "600", "--questions", str(QUESTIONS),
         "--max-tokens", str(MAX_TOKENS), "--out", str(out)])  # fmt: skip
    return out, json.loads(out.with_name(out.name + ".contexts.json").read_text())


def test_the_dataset_asks_each_stored_context_its_questions(guidellm_dataset, gateway):
    path, stored = guidellm_dataset
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == CONTEXTS * QUESTIONS and stored["model"] == MODEL_NAME
    assert len(stored["contexts"]) == CONTEXTS and all(c["chunks"] >= 2 for c in stored["contexts"])
    prefixes = [row["prefix"] for row in rows]
    assert len(set(prefixes)) == CONTEXTS and prefixes[0] != prefixes[1]  # round-robin over contexts
    assert len({row["prompt"] for row in rows}) > 1
    assert {row["output_tokens_count"] for row in rows} == {MAX_TOKENS}
    for context in stored["contexts"]:  # stored in the gateway, under the id the tool reported
        assert httpx.get(f"{gateway.url}/v1/contexts/{context['id']}", timeout=30).status_code == 200


def test_guidellm_loads_the_gateway_with_the_dataset_and_reports_goodput(guidellm_dataset, gateway, tmp_path):
    path, stored = guidellm_dataset
    report = tmp_path / "guidellm.json"
    hits = counter(gateway.url, "cachegen:prefix_cache_hits_total")
    prefilled = counter(gateway.url, "cachegen:prompt_tokens_total")
    requests = CONTEXTS * QUESTIONS
    command = tool_command("guidellm", gateway.url, MODEL_NAME, path, default_tokenizer_dir(), requests,
                           concurrency=2, report=str(report))  # fmt: skip
    run(command + " --disable-console-interactive", shell=True)

    benchmark = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    totals = benchmark["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (requests, 0, 0)
    assert benchmark["output_token_count"]["successful"]["total_sum"] == requests * MAX_TOKENS
    # goodput as guidellm defines it: the rate of requests that met every SLO (TTFT and TPOT here)
    assert 0.0 <= benchmark["slo_attainment"] <= 1.0
    assert benchmark["request_goodput"]["successful"]["mean"] >= 0.0

    # every request's prefix was a stored context: found in the store or the memory cache, not prefilled
    context_tokens = sum(c["tokens"] for c in stored["contexts"]) * QUESTIONS
    assert counter(gateway.url, "cachegen:prefix_cache_hits_total") - hits >= 0.95 * context_tokens
    assert counter(gateway.url, "cachegen:prompt_tokens_total") - prefilled < 0.1 * context_tokens
