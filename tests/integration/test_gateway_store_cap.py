"""The gateway's own collection: the periodic sweep (CACHEGEN_GC_INTERVAL_S) and the size cap."""

from __future__ import annotations

import time

import httpx
import pytest

from scheduler.layout import manifest_key
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name:
            return float(value)
    raise AssertionError(f"{name} not exported")


def stored_size(store) -> int:
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file())


def encode(url: str, ids: list[int], **extra) -> dict:
    r = httpx.post(f"{url}/contexts", json={"prompt_token_ids": ids, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_sweep_collects_an_expired_context_and_the_cap_evicts_the_least_recently_used(
    tmp_path, model_dir, tokenizer
):
    store = tmp_path / "store"
    ids = [
        tokenizer(f"Document number {n} says something of its own. " * 40)["input_ids"][:300]
        for n in range(3)
    ]
    # one context at every level is ~17 MB: the cap holds two, not three
    env = {
        "CACHEGEN_STORE": f"file://{store}",
        "CACHEGEN_GC_INTERVAL_S": "1",
        "CACHEGEN_GC_GRACE_S": "2",
        "CACHEGEN_STORE_MAX_BYTES": str(40 * 2**20),
    }
    with GatewayProcess(env, tmp_path / "gateway.log") as gw:
        url = gw.url
        brief = encode(url, ids[0], ttl_seconds=1)
        deadline = time.monotonic() + 30
        while (store / manifest_key(brief["id"])).exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not (store / manifest_key(brief["id"])).exists()  # collected without `gc`
        assert metric(url, "cachegen:contexts_expired_total") == 1
        # its chunks go once they are older than the grace period. Until then they count against
        # the cap, which would evict a live context in their place (and did, on a fast machine)
        while stored_size(store) > 2**20 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert stored_size(store) <= 2**20

        first = encode(url, ids[1])
        per_context = sum(first["bytes"].values())
        assert 2 * per_context < 40 * 2**20 < 3 * per_context, per_context
        second = encode(url, ids[2])
        # a request loads the first context's prefix: it is now more recent than the second
        time.sleep(1.1)
        out = httpx.post(
            f"{url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": ids[1] + [13], "max_tokens": 1, "temperature": 0},
            timeout=300,
        ).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 300
        third = encode(url, list(reversed(ids[2])))  # over the cap: one context must go
        listed = {c["id"] for c in httpx.get(f"{url}/contexts", timeout=30).json()["data"]}
        assert listed == {first["id"], third["id"]}, (first["id"], second["id"], third["id"], listed)
        assert metric(url, "cachegen:store_evicted_contexts_total") == 1
        assert metric(url, "cachegen:store_evicted_bytes_total") >= per_context
        assert 0 < metric(url, "cachegen:store_bytes") <= 40 * 2**20
        assert stored_size(store) <= 40 * 2**20
