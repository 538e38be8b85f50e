"""API keys, tenant isolation, TTLs and garbage collection, against a real gateway process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from codec import LOSSLESS
from scheduler.contexts import ContextStore
from scheduler.layout import manifest_key
from scheduler.prefix import make_fingerprint
from storage import open_store
from tests.conftest import MODEL_NAME
from tests.gateway_process import REPO, GatewayProcess

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tenants") / "store"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, model_dir, store_dir):
    env = {"CACHEGEN_STORE": f"file://{store_dir}", "CACHEGEN_API_KEY": f"{KEY_A},{KEY_B}"}
    with GatewayProcess(env, tmp_path_factory.mktemp("tenants-log") / "gateway.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer("Tenants keep their caches apart. " * 80)["input_ids"][:300]


def complete(url: str, key: str, ids: list[int], **extra) -> dict:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, **extra},
        headers=auth(key),
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples whose labels contain ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or (sample.startswith(name + "{") and labels in sample):
            total += float(value)
    return total


def test_requests_without_a_valid_key_get_401(keyed):
    for headers in ({}, auth("wrong"), {"Authorization": KEY_A}):
        for method, path, body in (
            (
                "POST",
                "/v1/chat/completions",
                {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
            ),
            ("GET", "/v1/models", None),
            ("GET", "/contexts", None),
            ("POST", "/contexts", {"text": "x"}),
        ):
            r = httpx.request(method, f"{keyed.url}{path}", json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{keyed.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=30).status_code == 200  # CACHEGEN_METRICS_AUTH off
    refused = metric(keyed.url, "cachegen:request_errors_total", 'code="invalid_api_key",status="401"')
    assert refused >= 12
    assert httpx.get(f"{keyed.url}/v1/models", headers=auth(KEY_B), timeout=30).status_code == 200


def test_one_tenants_context_is_invisible_to_another(keyed, prompt_ids):
    url = keyed.url
    created = httpx.post(
        f"{url}/contexts", json={"prompt_token_ids": prompt_ids}, headers=auth(KEY_A), timeout=300
    )
    assert created.status_code == 200, created.text
    ctx = created.json()["id"]
    assert ctx in [
        c["id"] for c in httpx.get(f"{url}/contexts", headers=auth(KEY_A), timeout=30).json()["data"]
    ]
    assert httpx.get(f"{url}/contexts", headers=auth(KEY_B), timeout=30).json()["data"] == []
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{url}/contexts/{ctx}", headers=auth(KEY_B), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "context_not_found"

    loaded_before = metric(url, "cachegen:kv_bytes_loaded_total")
    other = complete(url, KEY_B, prompt_ids)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert other["kv_cache_info"]["chunks"] == [] and other["kv_cache_info"]["faults"] == []
    assert metric(url, "cachegen:kv_bytes_loaded_total") == loaded_before  # no byte of A's was read

    salted = complete(url, KEY_A, prompt_ids, cache_salt="another salt of tenant A")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    own = complete(url, KEY_A, prompt_ids)
    assert own["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert metric(url, "cachegen:kv_bytes_loaded_total") > loaded_before
    assert httpx.get(f"{url}/contexts/{ctx}", headers=auth(KEY_A), timeout=30).status_code == 200


def test_a_context_with_a_ttl_is_gone_after_it_and_gc_collects_it(keyed, prompt_ids, store_dir):
    url = keyed.url
    pinned = httpx.post(
        f"{url}/contexts", json={"prompt_token_ids": prompt_ids}, headers=auth(KEY_B), timeout=300
    ).json()
    brief_ids = list(reversed(prompt_ids))
    brief = httpx.post(
        f"{url}/contexts",
        json={"prompt_token_ids": brief_ids, "ttl_seconds": 3},
        headers=auth(KEY_B),
        timeout=300,
    ).json()
    assert brief["expires_at"] is not None and pinned["expires_at"] is None
    assert complete(url, KEY_B, brief_ids)["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    time.sleep(max(0.0, brief["expires_at"] - time.time()) + 1.0)
    assert httpx.get(f"{url}/contexts/{brief['id']}", headers=auth(KEY_B), timeout=30).status_code == 404
    listed = [c["id"] for c in httpx.get(f"{url}/contexts", headers=auth(KEY_B), timeout=30).json()["data"]]
    assert brief["id"] not in listed and pinned["id"] in listed
    # the gateway's own LRU tier held the chunks and the index: still not served
    assert complete(url, KEY_B, brief_ids)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    before = {p.relative_to(store_dir).as_posix() for p in store_dir.rglob("*") if p.is_file()}
    report = run_gc(f"file://{store_dir}", "--grace-s", "0")
    after = {p.relative_to(store_dir).as_posix() for p in store_dir.rglob("*") if p.is_file()}
    assert report["expired_contexts"] == 1 and report["deleted_objects"] > 0
    assert any(k.endswith(f"/{brief['id']}.json") for k in before - after)
    assert any(k.endswith(f"/{pinned['id']}.json") for k in after)
    assert complete(url, KEY_B, prompt_ids)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256


def run_gc(store: str, *flags: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "app", "gc", "--store", store, *flags],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_gc_on_seaweedfs_removes_orphans_and_spares_live_contexts(seaweed, s3_bucket, monkeypatch):
    """The collector against a real S3 server: a live context, an expired one, write-back orphans."""
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    env = dict(os.environ)
    url = f"s3://{s3_bucket}/gc"
    store = open_store(url)
    pool = ThreadPoolExecutor(2)
    try:
        contexts = ContextStore(
            store, make_fingerprint(weights="w", config={}, vocabulary="v", chunk_size=8), "m", 8, pool
        )
        kv = torch.randn(2, 2, 1, 24, 4)
        live = contexts.save(list(range(24)), kv, [LOSSLESS], 0.0)
        expired = contexts.save(list(range(100, 124)), kv, [LOSSLESS], 0.0, ttl_seconds=1)
        contexts.save_chunks(contexts.keys(list(range(200, 224))), kv, [LOSSLESS])  # write-back: no manifest
        young = run_gc(url, "--grace-s", "3600", env=env)
        assert young["deleted_objects"] == 0  # every unreferenced chunk is within the grace period
        time.sleep(2.0)
        report = run_gc(url, "--grace-s", "1", env=env)
        # the expired manifest goes in whichever pass first sees it expired; its chunks wait for the grace
        assert young["expired_contexts"] + report["expired_contexts"] == 1
        assert report["collected_chunks"] == 6
        left = {info.key for info in store.list()}
        assert (
            manifest_key(live.id, live.tenant) in left
            and manifest_key(expired.id, expired.tenant) not in left
        )
        assert all(any(k.startswith(f"kv/{c}/") for k in left) for c in live.chunk_keys)
        assert not any(k.startswith(f"kv/{c}/") for k in left for c in expired.chunk_keys)
    finally:
        pool.shutdown()
        store.close()
