"""The in-memory prefix cache through a real gateway process: hits, exactness, tenants, n, eviction."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()
KEYS = ("key-of-tenant-a", "key-of-tenant-b")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("prefix-cache")
    env = {"CACHEGEN_STORE": f"file://{root / 'store'}", "CACHEGEN_API_KEY": ",".join(KEYS)}
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


def chat(url: str, key: str, question: str, **extra) -> dict:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": TEXT[:2000]}, {"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, key: str, name: str) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{url}/metrics", headers=headers).text
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_a_repeated_request_comes_from_memory_and_answers_as_a_full_prefill(gateway):
    a = KEYS[0]
    first = chat(gateway.url, a, "Who created Python?")
    assert first["kv_cache_info"]["memory_tokens"] == 0
    hits_before = metric(gateway.url, a, "cachegen:memory_prefix_cache_hits_total")
    again = chat(gateway.url, a, "Who created Python?")
    info = again["kv_cache_info"]
    prompt = again["usage"]["prompt_tokens"]
    assert info["memory_tokens"] >= prompt - 16 and info["memory_tokens"] % 16 == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == info["memory_tokens"]
    assert info["recomputed_tokens"] == prompt - info["memory_tokens"]
    full = chat(gateway.url, a, "Who created Python?", kv_cache=False)
    assert again["choices"][0]["message"] == full["choices"][0]["message"] == first["choices"][0]["message"]
    assert (
        metric(gateway.url, a, "cachegen:memory_prefix_cache_hits_total")
        >= hits_before + info["memory_tokens"]
    )


def test_a_new_question_on_the_same_context_hits_its_blocks(gateway):
    a = KEYS[0]
    chat(gateway.url, a, "When was Python first released?")
    other = chat(gateway.url, a, "What is Python named after?")
    assert other["kv_cache_info"]["memory_tokens"] >= 400  # the system message's blocks
    full = chat(gateway.url, a, "What is Python named after?", kv_cache=False)
    assert other["choices"][0]["message"] == full["choices"][0]["message"]


def test_another_tenant_never_hits(gateway):
    a, b = KEYS
    chat(gateway.url, a, "Which version removed print statements?")
    other = chat(gateway.url, b, "Which version removed print statements?")
    assert (
        other["kv_cache_info"]["memory_tokens"] == 0
        and other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )
    assert (
        chat(gateway.url, b, "Which version removed print statements?")["kv_cache_info"]["memory_tokens"] > 0
    )


def test_the_choices_of_one_request_share_its_prompt(gateway):
    a = KEYS[0]
    before = metric(gateway.url, a, "cachegen:memory_prefix_cache_hits_total")
    copied = metric(gateway.url, a, "cachegen:memory_prefix_cache_copied_tokens")
    out = chat(gateway.url, a, "Name three Python features. Unique question 7.", n=3, temperature=0.8, seed=1)
    assert len(out["choices"]) == 3
    prompt = out["usage"]["prompt_tokens"]
    # choices 1 and 2 attached the first choice's prompt (all but its last partial block) while it
    # was still generating: shared, not copied
    assert metric(gateway.url, a, "cachegen:memory_prefix_cache_hits_total") - before >= 2 * (prompt - 16)
    assert metric(gateway.url, a, "cachegen:memory_prefix_cache_copied_tokens") == copied


def test_a_question_on_a_context_still_generating_shares_its_kv_and_answers_as_a_full_prefill(gateway):
    a = KEYS[0]
    copied = metric(gateway.url, a, "cachegen:memory_prefix_cache_copied_tokens")
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "system", "content": TEXT[:2000]}, {"role": "user", "content": "Tell a story."}],
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {a}"}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, headers=headers, timeout=600) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:  # the first token: the long request's prompt is published
            if line.startswith("data:") and '"content"' in line:
                break
        other = chat(gateway.url, a, "What is Python named after? A question asked meanwhile.")
        finished = any(line.startswith("data: [DONE]") for line in lines)
    assert finished
    assert other["kv_cache_info"]["memory_tokens"] >= 400
    assert metric(gateway.url, a, "cachegen:memory_prefix_cache_copied_tokens") == copied
    full = chat(gateway.url, a, "What is Python named after? A question asked meanwhile.", kv_cache=False)
    assert other["choices"][0]["message"] == full["choices"][0]["message"]


@pytest.fixture(scope="module")
def small_gateway(tmp_path_factory) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("prefix-cache-small")
    # room for about three requests' buffers: cached ones must make way for new ones
    env = {"CACHEGEN_STORE": f"file://{root / 'store'}", "CACHEGEN_KV_MEMORY_BYTES": str(3 * 450 * 46080)}
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


def test_cached_buffers_are_evicted_for_new_requests_and_the_pool_never_overcommits(small_gateway):
    url = small_gateway.url
    budget = metric(url, "", "cachegen:kv_memory_budget_bytes")
    for i in range(6):
        body = {
            "model": MODEL_NAME,
            "prompt": f"Request {i}. " + TEXT[i * 300 : i * 300 + 1500],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        assert metric(url, "", "cachegen:kv_memory_used_bytes") <= budget
    assert metric(url, "", "cachegen:memory_prefix_cache_evicted_runs") >= 2
    assert 0 < metric(url, "", "cachegen:memory_prefix_cache_bytes") <= budget


def test_a_request_waiting_for_memory_that_only_its_own_hit_holds_is_served(small_gateway):
    """The budget holds 1,350 tokens. A finishes with 704 prompt tokens and room for 100 more,
    so its cached buffer holds 816 tokens' memory (whole 16-token blocks). B continues A's
    prompt and asks for room for 600: too large to take A's buffer over, so it would share A's
    704 tokens and need 608 of its own, where at most 534 are free. Only A's cached buffer could
    make room, and B's hit on it pinned it: B waited for ever. A waiting request now holds no
    hit, so A's buffer is evicted and B is served from a buffer of its own."""
    url = small_gateway.url
    budget = metric(url, "", "cachegen:kv_memory_budget_bytes")
    ids = [100 + (i * 7919) % 40000 for i in range(712)]  # a prompt of its own: no other run holds it

    def complete(prompt: list[int], max_tokens: int) -> dict:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        # a stop string ends both early; the memory reserved is still prompt + max_tokens
        r = httpx.post(f"{url}/v1/completions", json={**body, "stop": [" ", ".", "\n"]}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    complete(ids[:704], 100)
    # the situation above: A's buffer is in the cache (it is handed over just after A's
    # response), and B would hit it
    deadline = time.monotonic() + 10
    while metric(url, "", "cachegen:memory_prefix_cache_bytes") < 816 * 46080:
        assert time.monotonic() < deadline, "A's buffer never reached the cache"
        time.sleep(0.05)
    b = complete(ids, 600)
    assert b["usage"]["prompt_tokens"] == 712 and b["choices"][0]["finish_reason"] in ("stop", "length")
    assert b["kv_cache_info"]["memory_tokens"] == 0  # A's buffer made way
    assert metric(url, "", "cachegen:kv_memory_used_bytes") <= budget
    assert metric(url, "", "cachegen:num_requests_waiting") == 0
