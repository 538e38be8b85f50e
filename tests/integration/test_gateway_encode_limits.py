"""Pre-encodes are bounded per tenant and stop when their client leaves (a real gateway process).

One tenant's burst of pre-encodes must not queue another tenant's work behind
it: beyond ``max_encodes_per_tenant`` in flight a tenant gets 429 with
``Retry-After``, while another tenant is still served. A client that goes away
mid-encode stops the prefill, stores nothing, and frees its slot.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "encode-tenant-a", "encode-tenant-b"
TOKENS = 1024  # a prefill of seconds on a CPU: long enough to overlap the requests below


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def context_ids(seed: int, n: int = TOKENS) -> list[int]:
    """Distinct contexts: random ids from the vocabulary (each seed is its own context)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def post(url: str, key: str, seed: int, timeout: float = 300) -> httpx.Response:
    return httpx.post(
        f"{url}/contexts", json={"prompt_token_ids": context_ids(seed)}, headers=auth(key), timeout=timeout
    )


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", headers=auth(KEY_A)).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    return 0.0


def contexts_of(url: str, key: str) -> list[str]:
    return [c["id"] for c in httpx.get(f"{url}/contexts", headers=auth(key), timeout=30).json()["data"]]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_dir):
    env = {
        "CACHEGEN_STORE": f"file://{tmp_path_factory.mktemp('encode-limits') / 'store'}",
        "CACHEGEN_API_KEY": f"{KEY_A},{KEY_B}",
        "CACHEGEN_MAX_ENCODES_PER_TENANT": "2",
        "CACHEGEN_ENCODE_THREADS": "3",
    }
    with GatewayProcess(env, tmp_path_factory.mktemp("encode-limits-log") / "gateway.log") as proc:
        yield proc


def test_a_tenant_beyond_its_limit_gets_429_and_another_tenant_is_still_served(gateway):
    url = gateway.url
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(post, url, KEY_A, seed) for seed in (1, 2)]
        time.sleep(1.0)  # both are prefilling now (each takes seconds)
        refused = post(url, KEY_A, 3)
        other = pool.submit(post, url, KEY_B, 4)
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers=auth(KEY_A),
            timeout=120,
        )
        results = [f.result() for f in running]
        other_result = other.result()
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "5"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "2 pre-encodes of this tenant" in error["message"]
    assert chat.status_code == 200, chat.text  # the same tenant's chats are not pre-encodes
    assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
    assert other_result.status_code == 200, other_result.text
    assert len(contexts_of(url, KEY_A)) == 2 and len(contexts_of(url, KEY_B)) == 1
    assert post(url, KEY_A, 3).status_code == 200  # the slots are free again


def test_a_client_that_leaves_mid_encode_stops_it_and_stores_nothing(gateway):
    url = gateway.url
    before = contexts_of(url, KEY_A)
    cancelled = metric(url, "cachegen:contexts_encode_cancelled_total")
    with pytest.raises(httpx.TimeoutException):
        post(url, KEY_A, 10, timeout=1.0)  # the client gives up while the prefill runs
    deadline = time.monotonic() + 30
    while (
        metric(url, "cachegen:contexts_encode_cancelled_total") == cancelled and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert metric(url, "cachegen:contexts_encode_cancelled_total") == cancelled + 1
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    assert contexts_of(url, KEY_A) == before
    # its slot was given back: two more of the same tenant's pre-encodes are both admitted
    with ThreadPoolExecutor(2) as pool:
        again = list(pool.map(lambda seed: post(url, KEY_A, seed), (11, 12)))
    assert [r.status_code for r in again] == [200, 200], [r.text for r in again]


@pytest.fixture(scope="module")
def small_gateway(tmp_path_factory, model_dir):
    """KV memory for one long pre-encode, not for a second one beside it."""
    kv_per_token = 30 * 2 * 3 * 64 * 4  # the default model's float32 KV
    env = {
        "CACHEGEN_STORE": f"file://{tmp_path_factory.mktemp('encode-memory') / 'store'}",
        "CACHEGEN_KV_MEMORY_BYTES": str((LONG + TOKENS // 2) * kv_per_token),
        "CACHEGEN_PREFIX_CACHE": "false",
    }
    with GatewayProcess(env, tmp_path_factory.mktemp("encode-memory-log") / "gateway.log") as proc:
        yield proc


LONG = 3072  # tokens: a pre-encode that holds its KV memory for seconds (prefill, then encode)


def test_a_pre_encode_waiting_for_kv_memory_stops_when_its_client_leaves(small_gateway):
    """The second pre-encode cannot get its memory while the first holds it; its client leaves,
    and it stops there, while the first still runs, instead of waiting to prefill for nobody."""
    url = small_gateway.url
    cancelled = metric(url, "cachegen:contexts_encode_cancelled_total")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            httpx.post,
            f"{url}/contexts",
            json={"prompt_token_ids": context_ids(30, LONG)},
            headers=auth(KEY_A),
            timeout=300,
        )
        time.sleep(0.5)  # the first has its memory and prefills
        with pytest.raises(httpx.TimeoutException):
            post(url, KEY_A, 31, timeout=0.5)  # waits for memory; the client gives up
        deadline = time.monotonic() + 3
        while (
            metric(url, "cachegen:contexts_encode_cancelled_total") == cancelled
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        stopped_while_first_ran = not first.done()
        assert metric(url, "cachegen:contexts_encode_cancelled_total") == cancelled + 1
        assert first.result().status_code == 200, first.result().text
    assert stopped_while_first_ran, "the cancelled pre-encode waited for the first one's memory"
    assert len(contexts_of(url, KEY_A)) == 1  # the cancelled one stored nothing
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0
