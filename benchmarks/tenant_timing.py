"""Does tenant B's time to first token tell whether tenant A has stored a prefix? (CVE-2025-46570)

Starts a gateway with two API keys on a fresh local store. Tenant A pre-encodes
a context. Then, interleaved so that drift in machine load hits every arm
alike, ``--trials`` times each:

* ``b_on_a_stored``: tenant B sends A's context as its prompt;
* ``b_on_unstored``: tenant B sends a prompt of the same length nobody stored;
* ``a_on_a_stored``: tenant A sends its own context (the control: a real hit).

TTFT is the client's time to the first streamed token. The two arms of B are
compared with a two-sided Mann-Whitney U test (indistinguishable: a large
p-value); the control against B's unstored arm shows that the same test does
tell a hit from a miss. Writes JSON (``--out``) and prints a table.

    python -m benchmarks.tenant_timing --trials 50 --out benchmarks/results/tenant_timing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.stats import mann_whitney
from tests.gateway_process import GatewayProcess

MODEL = "SmolLM2-135M-Instruct"
KEY_A, KEY_B = "timing-tenant-a", "timing-tenant-b"
ARMS = ("b_on_a_stored", "b_on_unstored", "a_on_a_stored")


def ttft(client: httpx.Client, url: str, key: str, ids: list[int]) -> tuple[float, int]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    cached = None
    headers = {"Authorization": f"Bearer {key}"}
    with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - started
            info = chunk.get("kv_cache_info")
            if info is not None:
                cached = info["cached_tokens"]
    assert first is not None and cached is not None
    return first, cached


def measure(url: str, stored_ids: list[int], unstored_ids: list[int], trials: int) -> dict:
    """Run the three arms, interleaved; A's context must already be stored."""
    prompts = {"b_on_a_stored": (KEY_B, stored_ids), "b_on_unstored": (KEY_B, unstored_ids),
               "a_on_a_stored": (KEY_A, stored_ids)}  # fmt: skip
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cached: dict[str, set[int]] = {arm: set() for arm in ARMS}
    with httpx.Client(timeout=300) as client:
        for arm in ARMS:  # warm-up
            ttft(client, url, *prompts[arm])
        for trial in range(trials):
            order = ARMS if trial % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                seconds, hit = ttft(client, url, *prompts[arm])
                times[arm].append(seconds)
                cached[arm].add(hit)
    _, p_tenants = mann_whitney(times["b_on_a_stored"], times["b_on_unstored"])
    _, p_control = mann_whitney(times["a_on_a_stored"], times["b_on_unstored"])
    return {
        "trials": trials,
        "prompt_tokens": len(stored_ids),
        "arms": {
            arm: {
                "cached_tokens": sorted(cached[arm]),
                "ttft_ms_p10": _ms(_quantile(times[arm], 0.1)),
                "ttft_ms_p50": _ms(statistics.median(times[arm])),
                "ttft_ms_p90": _ms(_quantile(times[arm], 0.9)),
                "ttft_ms": [_ms(t) for t in times[arm]],
            }
            for arm in ARMS
        },
        "p_value_b_stored_vs_unstored": p_tenants,
        "p_value_control_hit_vs_miss": p_control,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def prompts(tokenizer, tokens: int = 300) -> tuple[list[int], list[int]]:
    """Two prompts of ``tokens`` tokens with nothing in common (so no chunk of one is the other's)."""
    stored = tokenizer("Tenant A's private notes on the quarterly plan. " * 60)["input_ids"][:tokens]
    unstored = tokenizer("A different document that nobody has stored anywhere. " * 60)["input_ids"][:tokens]
    assert len(stored) == len(unstored) == tokens
    return stored, unstored


def print_table(result: dict) -> None:
    print(f"{'arm':<15} {'cached':>7} {'p10 ms':>8} {'p50 ms':>8} {'p90 ms':>8}")
    for arm, row in result["arms"].items():
        print(
            f"{arm:<15} {','.join(map(str, row['cached_tokens'])):>7} {row['ttft_ms_p10']:>8.1f} "
            f"{row['ttft_ms_p50']:>8.1f} {row['ttft_ms_p90']:>8.1f}"
        )
    print(
        f"Mann-Whitney p, B on A's stored prefix vs B on an unstored one: {result['p_value_b_stored_vs_unstored']:.3f}"
    )
    print(
        f"Mann-Whitney p, control (A's hit vs B's miss):                 {result['p_value_control_hit_vs_miss']:.2e}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tenant_timing.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.loading import convert_default_model, default_cache_dir

    tokenizer = AutoTokenizer.from_pretrained(convert_default_model(default_cache_dir()))
    stored, unstored = prompts(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"CACHEGEN_STORE": f"file://{tmp}/store", "CACHEGEN_API_KEY": f"{KEY_A},{KEY_B}",
               "CACHEGEN_LOG_LEVEL": "warning"}  # fmt: skip
        with GatewayProcess(env, Path(tmp) / "gateway.log") as gw:
            headers = {"Authorization": f"Bearer {KEY_A}"}
            httpx.post(f"{gw.url}/contexts", json={"prompt_token_ids": stored}, headers=headers, timeout=600)
            result = measure(gw.url, stored, unstored, args.trials)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "tenant_timing", **result}, indent=2))
    print_table(result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
