"""Adaptive loading through an emulated link: SeaweedFS behind a throttling proxy, a real gateway.

The context is pre-encoded straight into S3; the gateway under test reaches S3
only through ``LinkProxy``, which holds the whole link to a set rate, with its
in-memory tier off so every chunk crosses the link.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.link_proxy import LinkProxy
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

PREFIX = "adaptive"


@pytest.fixture(scope="module")
def context_ids(tokenizer) -> list[int]:
    text = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()
    return tokenizer(text)["input_ids"][:1300]  # five full chunks and a 20-token tail


@pytest.fixture(scope="module")
def bucket(seaweed) -> Iterator[str]:
    name = seaweed.create_bucket()
    yield name
    if seaweed.running:
        seaweed.delete_bucket(name)


@pytest.fixture(scope="module")
def stored(seaweed, bucket, context_ids, tmp_path_factory) -> dict:
    env = {**seaweed.env(), "CACHEGEN_STORE": f"s3://{bucket}/{PREFIX}"}
    with GatewayProcess(env, tmp_path_factory.mktemp("encode") / "gateway.log") as gw:
        r = httpx.post(f"{gw.url}/contexts", json={"prompt_token_ids": context_ids}, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def link(seaweed) -> Iterator[LinkProxy]:
    host, port = seaweed.endpoint_url.removeprefix("http://").split(":")
    with LinkProxy(target=(host, int(port)), rate_bps="20mbit") as proxy:
        yield proxy


@pytest.fixture(scope="module")
def gateway(seaweed, bucket, link, stored, tmp_path_factory) -> Iterator[GatewayProcess]:
    env = {
        **seaweed.env(),
        "AWS_ENDPOINT_URL": link.url,
        "CACHEGEN_STORE": f"s3://{bucket}/{PREFIX}",
        "CACHEGEN_STORE_CACHE_BYTES": "0",
        "CACHEGEN_PREFIX_CACHE": "false",  # every request loads over the link: that is what is tested
    }
    with GatewayProcess(env, tmp_path_factory.mktemp("adaptive") / "gateway.log") as gw:
        yield gw


def complete(url: str, ids: list[int], max_tokens: int = 1, **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def prompt_seconds(info: dict) -> float:
    return (info["load_ms"] + info["prefill_ms"]) / 1000


def sources(info: dict) -> list[str]:
    return [c["level"] or c["source"] for c in info["chunks"]]


def test_named_level_is_honoured_exactly(gateway, link, context_ids):
    link.set_rate("20mbit")
    question = context_ids + context_ids[:5]
    info = complete(gateway.url, question, kv_quality="high", kv_slo_ms=1)["kv_cache_info"]
    assert sources(info) == ["high"] * 6  # a budget it cannot meet changes nothing
    assert info["cached_tokens"] == len(context_ids)


def test_tight_budget_at_a_low_rate_is_met_by_mixing_levels_and_text(gateway, link, context_ids):
    link.set_rate("20mbit")
    question = context_ids + context_ids[:5]
    # what single levels cost on this link, now (the machine may be busy); this also measures it
    low = prompt_seconds(complete(gateway.url, question, kv_quality="low")["kv_cache_info"])
    medium = prompt_seconds(complete(gateway.url, question, kv_quality="medium")["kv_cache_info"])
    assert medium > low
    budget = (low + medium) / 2  # all-medium does not fit; all-low, or some mix, does
    info = complete(gateway.url, question, kv_slo_ms=budget * 1000)["kv_cache_info"]
    used = sources(info)
    timings = [(c["level"] or c["source"], c["fetch_ms"], c["decode_ms"], c["prefill_ms"]) for c in info["chunks"]]
    assert info["budget_ms"] == pytest.approx(budget * 1000, abs=0.01)
    assert info["planned_ms"] <= info["budget_ms"], (info["planned_ms"], used, timings)
    assert len(set(used)) >= 2 or set(used) == {"low"}, used
    # a raw 256-token chunk (11.8 MB) takes 4.7 s of this link: no budget here has room for one;
    # the 20-token tail raw (0.9 MB) fits when text chunks leave time over
    assert all(c["level"] != "lossless" for c in info["chunks"] if c["tokens"] == 256), used
    assert info["bandwidth_mbps"] < 40
    assert info["slo_met"] == (info["prompt_ms"] <= info["budget_ms"])
    # The plan is met on a quiet machine (0.8-0.9x the budget in 8 runs alone). A busy one slows
    # the text chunks' prefill most: in 3 of 5 full CI runs this request took 1.23-1.32x the
    # budget, and with one other process spinning a core, text chunks took 3-5x their planned
    # time. The plan is checked above; its time is held to a loose bound, for gross mistakes: one
    # was caught here, text chunks at 2.1-2.3x the budget while every step faulted its
    # activations' pages in again (app/allocator.py).
    assert prompt_seconds(info) <= 1.6 * budget, (prompt_seconds(info), budget, used, timings)


def test_slow_link_falls_back_to_text(gateway, link, context_ids):
    link.set_rate("2mbit")
    try:
        question = context_ids + context_ids[:7]
        complete(gateway.url, question[:600], kv_quality="low")  # measure the slower link
        info = complete(gateway.url, question, kv_slo_ms=1)["kv_cache_info"]  # nothing can meet it
        used = sources(info)
        assert "text" in used, used  # 0.44 MB at 2 Mbit/s is ~1.8 s a chunk; prefill is faster
        assert info["slo_met"] is False
    finally:
        link.set_rate("20mbit")


def test_lossless_through_the_link_is_token_identical_to_full_prefill(gateway, link, context_ids):
    link.set_rate("400mbit")
    try:
        question = context_ids[:530]
        reused = complete(gateway.url, question, max_tokens=12, kv_quality="lossless")
        fresh = complete(gateway.url, question, max_tokens=12, kv_cache=False)
        assert reused["kv_cache_info"]["cached_tokens"] == 512
        assert reused["choices"][0]["text"] == fresh["choices"][0]["text"]
    finally:
        link.set_rate("20mbit")


def test_metrics_show_the_plan(gateway):
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in (
        'cachegen:kv_chunks_total{source="low"}',
        "cachegen:kv_bandwidth_estimate_bytes_per_second",
        'cachegen:kv_slo_total{outcome="missed"}',
        'cachegen:kv_chunk_seconds_count{stage="fetch"}',
        'cachegen:kv_bytes_loaded_total{level="medium"}',
    ):
        assert name in text, name
