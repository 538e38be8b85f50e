"""What a router asks of a worker (app/serving_worker.py), on the session's gateway process."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Why is the sky blue?"}]


def test_render_answers_the_token_ids_the_request_is_served_with(gateway):
    chat = httpx.post(
        f"{gateway.url}/v1/chat/completions/render",
        json={"model": MODEL_NAME, "messages": MESSAGES, "no_stop_trim": False},
    )
    tokenized = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert chat.status_code == 200 and chat.json()["token_ids"] == tokenized.json()["tokens"]

    prompt = httpx.post(f"{gateway.url}/v1/completions/render", json={"model": MODEL_NAME, "prompt": "Hello there"})
    expected = httpx.post(f"{gateway.url}/tokenize", json={"model": MODEL_NAME, "prompt": "Hello there"}).json()
    assert prompt.json()["token_ids"] == expected["tokens"]
    ids = httpx.post(f"{gateway.url}/v1/completions/render", json={"model": MODEL_NAME, "prompt": [1, 2, 3]})
    assert ids.json()["token_ids"] == [1, 2, 3]
    # served with these ids: the completion's prompt_tokens agree
    done = httpx.post(
        f"{gateway.url}/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}, timeout=120
    )
    assert done.json()["usage"]["prompt_tokens"] == len(chat.json()["token_ids"])


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions/render", {"model": "other", "messages": MESSAGES}, 404, "model_not_found"),
        ("/v1/chat/completions/render", {"model": MODEL_NAME, "messages": []}, 400, None),
        ("/v1/completions/render", {"model": MODEL_NAME, "prompt": [10**9]}, 400, None),
        ("/v1/completions/render", {"model": MODEL_NAME}, 400, None),
    ],
)
def test_render_refuses_what_the_request_would_be_refused_for(gateway, path, body, status, code):
    r = httpx.post(f"{gateway.url}{path}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code:
        assert error["code"] == code


def test_load_server_and_model_info(gateway):
    load = httpx.get(f"{gateway.url}/get_load").json()
    assert isinstance(load["load"], int) and load["load"] >= load["num_reqs"] >= 0
    assert load["replica"] == httpx.get(f"{gateway.url}/get_server_info").json()["replica"]
    info = httpx.get(f"{gateway.url}/get_server_info").json()
    assert info["served_model_name"] == MODEL_NAME and info["chunk_size"] == 256
    assert not any("secret" in k or "key" in k for k in info)
    assert httpx.get(f"{gateway.url}/get_model_info").json()["model_path"] == MODEL_NAME
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert f'cachegen:replica_info{{replica="{info["replica"]}"}} 1.0' in metrics
