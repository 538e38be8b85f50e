"""Restart on the same store, overload (429), and clients that go away mid-stream."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow


def test_second_process_finds_contexts_of_the_first(tmp_path, model_dir, tokenizer):
    store = f"file://{tmp_path / 'store'}"
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"][:300]
    with GatewayProcess({"CACHEGEN_STORE": store}, tmp_path / "first.log") as first:
        created = httpx.post(f"{first.url}/contexts", json={"prompt_token_ids": ids}, timeout=300).json()
    assert created["cached_tokens"] == 300  # one full chunk and the 44-token tail
    with GatewayProcess({"CACHEGEN_STORE": store}, tmp_path / "second.log") as second:
        listed = httpx.get(f"{second.url}/contexts").json()["data"]
        assert [c["id"] for c in listed] == [created["id"]]
        out = httpx.post(
            f"{second.url}/v1/completions",
            json={"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0},
            timeout=300,
        ).json()
        # the prompt is the context itself: its last token is prefilled, so the tail is not used
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
        deleted = httpx.delete(f"{second.url}/contexts/{created['id']}").json()
        assert deleted["deleted"] is True
        assert httpx.get(f"{second.url}/contexts/{created['id']}").status_code == 404


@pytest.fixture(scope="module")
def tiny_queue_gateway(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("tinyqueue")
    env = {"CACHEGEN_STORE": "memory://", "CACHEGEN_MAX_QUEUE": "1"}
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


def long_stream_body() -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }


def test_overload_answers_429(tiny_queue_gateway):
    url = tiny_queue_gateway.url
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_stream_body(), timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the response
        next(lines)  # the job is admitted and running
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=1
            )
        next(lines)  # the admitted stream is unaffected


def test_disconnect_frees_the_slot(tiny_queue_gateway):
    url = tiny_queue_gateway.url
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=long_stream_body(), timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # the client is gone; the job must stop at its next token and free the only slot
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/health").json()["in_flight"] == 0:
            break
        time.sleep(0.2)
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        timeout=120,
    )
    assert r.status_code == 200, r.text


def test_requests_queue_and_all_finish(tmp_path, model_dir):
    env = {"CACHEGEN_STORE": "memory://", "CACHEGEN_MAX_QUEUE": "4"}
    with GatewayProcess(env, tmp_path / "gateway.log") as proc:
        results: list[int] = []

        def one() -> None:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            results.append(httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120).status_code)

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 4
