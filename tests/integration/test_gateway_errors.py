"""Bad input gets an OpenAI error object and the right status, never a 500."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow


def post(gateway, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", timeout=120, **kwargs)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def chat(**overrides) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(overrides)
    return body


def test_malformed_json(gateway):
    r = post(gateway, "/v1/chat/completions", content=b'{"model": "x", "messages": [', headers={
        "content-type": "application/json"
    })
    err = assert_error(r, 400)
    assert "JSON" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(messages=[]), "messages"),
        (chat(messages="hello"), "messages"),
        (chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(max_tokens=-5), "max_tokens"),
        (chat(max_tokens="ten"), "max_tokens"),
        (chat(temperature=3), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(n=9), "n"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ],
)
def test_invalid_chat_fields(gateway, body, param):
    err = assert_error(post(gateway, "/v1/chat/completions", json=body), 400)
    assert err["param"] is not None and err["param"].startswith(param)


def test_unknown_model_is_404(gateway):
    assert_error(post(gateway, "/v1/chat/completions", json=chat(model="gpt-17")), 404, "model_not_found", "model")


def test_unknown_kv_quality(gateway):
    assert_error(post(gateway, "/v1/chat/completions", json=chat(kv_quality="ultra")), 400, param="kv_quality")


def test_context_too_long(gateway):
    long_text = "hello " * 9000
    r = post(gateway, "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": long_text}]))
    assert_error(r, 400, "context_length_exceeded")


def test_max_tokens_beyond_window(gateway):
    assert_error(post(gateway, "/v1/chat/completions", json=chat(max_tokens=9000)), 400, "context_length_exceeded")


def test_completions_bad_inputs(gateway):
    base = {"model": MODEL_NAME, "max_tokens": 1}
    assert_error(post(gateway, "/v1/completions", json={**base, "prompt": ""}), 400)
    assert_error(post(gateway, "/v1/completions", json={**base, "prompt": [10**9]}), 400, param="prompt")
    assert_error(post(gateway, "/v1/completions", json={**base, "prompt": "x", "max_tokens": 0}), 400)
    assert_error(post(gateway, "/v1/completions", json={**base, "prompt": "x", "logprobs": 9}), 400)


def test_contexts_bad_inputs(gateway):
    assert_error(post(gateway, "/contexts", json={}), 400)
    assert_error(post(gateway, "/contexts", json={"text": "a", "prompt_token_ids": [1]}), 400)
    assert_error(post(gateway, "/contexts", json={"text": "a", "levels": ["nope"]}), 400, param="levels")
    assert_error(post(gateway, "/contexts", json={"text": "a", "model": "other"}), 404, "model_not_found")


@pytest.mark.parametrize("ctx_id", ["ctx-00000000000000000000000000000000", "nonsense", "..%2F..%2Fetc"])
def test_unknown_context_id(gateway, ctx_id):
    assert_error(httpx.get(f"{gateway.url}/contexts/{ctx_id}"), 404)
    assert_error(httpx.delete(f"{gateway.url}/contexts/{ctx_id}"), 404)


def test_openai_client_error_classes(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)
