"""Two gateway processes over one S3 store (SeaweedFS), their model files at different paths.

Keys come from what determines the KV, never from a path: B reuses, lists and
reads what A stored; a re-POST encodes nothing; concurrent POSTs of one new
context on A and B end in one context both reuse; a delete on A reaches B
within the index's staleness bound.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scheduler.stored import INDEX_MAX_AGE_S
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()[:2600]


def document(n: int) -> str:
    """A distinct ~600-token context per test: its first chunk, and so every key, differs."""
    return f"Document {n}.\n{TEXT}"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, model_dir, seaweed) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("replicas")
    bucket = seaweed.create_bucket()
    moved = root / "models" / "copy-of-smollm2"
    shutil.copytree(model_dir, moved, copy_function=shutil.copy)  # another path, new mtimes
    common = {
        **seaweed.env(),
        "CACHEGEN_STORE": f"s3://{bucket}/shared",
        "CACHEGEN_STORE_CACHE_BYTES": "0",  # every read goes to S3: what one writes, the other sees
        "CACHEGEN_PREFIX_CACHE": "false",  # what is reused comes from the store, not from memory
        "CACHEGEN_TORCH_THREADS": "1",  # two replicas on a small machine: a core each (docs/scaleout.md)
    }
    a = GatewayProcess(common, root / "a.log")
    b = GatewayProcess(
        {**common, "CACHEGEN_MODEL": str(moved), "CACHEGEN_SERVED_MODEL_NAME": MODEL_NAME}, root / "b.log"
    )
    with a, b:
        yield a, b
    seaweed.delete_bucket(bucket)


def post_context(url: str, text: str, **extra) -> dict:
    r = httpx.post(f"{url}/contexts", json={"text": text, **extra}, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def ask(url: str, text: str) -> dict:
    body = {
        "model": MODEL_NAME,
        "prompt": text + "\nQuestion: who started it?\nAnswer:",
        "max_tokens": 6,
        "temperature": 0,
        "kv_quality": "lossless",
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def encoded_count(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("cachegen:contexts_encoded_total "):
            return float(line.split()[-1])
    raise AssertionError("no contexts_encoded counter")


def test_b_reuses_lists_and_reads_what_a_stored(replicas):
    a, b = replicas
    text = document(1)
    created = post_context(a.url, text)
    assert created["encoded"] is True and created["cached_tokens"] > 256

    listed = httpx.get(f"{b.url}/contexts").json()["data"]
    assert created["id"] in [c["id"] for c in listed]
    got = httpx.get(f"{b.url}/contexts/{created['id']}")
    assert got.status_code == 200 and got.json()["cached_tokens"] == created["cached_tokens"]

    hit = ask(b.url, text)
    assert cached(hit) == created["cached_tokens"]  # B reused every stored token
    full = httpx.post(
        f"{b.url}/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": text + "\nQuestion: who started it?\nAnswer:",
            "max_tokens": 6,
            "temperature": 0,
            "kv_cache": False,
        },
        timeout=600,
    ).json()
    assert hit["choices"][0]["text"] == full["choices"][0]["text"]


def test_a_repost_is_answered_without_encoding(replicas):
    a, b = replicas
    text = document(2)
    first = post_context(a.url, text)
    before = encoded_count(b.url), encoded_count(a.url)
    started = time.perf_counter()
    again = post_context(b.url, text)
    took = time.perf_counter() - started
    assert again["id"] == first["id"] and again["encoded"] is False
    assert again["encode_seconds"] == 0.0 and again["cached_tokens"] == first["cached_tokens"]
    assert again["bytes"] == first["bytes"] and again["created"] == first["created"]
    assert (encoded_count(b.url), encoded_count(a.url)) == before
    assert took < first["encode_seconds"]  # no prefill, no encode: index, manifest and LISTs only


def test_concurrent_posts_on_both_replicas_end_in_one_context(replicas):
    a, b = replicas
    text = document(3)
    answers: dict[str, dict] = {}

    def post(name: str, url: str) -> None:
        answers[name] = post_context(url, text)

    threads = [threading.Thread(target=post, args=(n, g.url)) for n, g in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers["a"]["id"] == answers["b"]["id"]
    assert answers["a"]["cached_tokens"] == answers["b"]["cached_tokens"]
    ctx_id = answers["a"]["id"]
    for gateway in (a, b):
        assert [c["id"] for c in httpx.get(f"{gateway.url}/contexts").json()["data"]].count(ctx_id) == 1
        assert cached(ask(gateway.url, text)) == answers["a"]["cached_tokens"]


def test_a_delete_on_a_reaches_b_within_the_index_bound(replicas):
    a, b = replicas
    text = document(4)
    created = post_context(a.url, text)
    assert cached(ask(b.url, text)) == created["cached_tokens"]  # B has read the index
    assert httpx.delete(f"{a.url}/contexts/{created['id']}").status_code == 200
    assert httpx.get(f"{b.url}/contexts/{created['id']}").status_code == 404
    time.sleep(INDEX_MAX_AGE_S + 0.5)
    assert cached(ask(b.url, text)) == 0
