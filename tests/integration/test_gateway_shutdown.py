"""SIGTERM: the gateway stops accepting, lets running requests finish within the grace, then cancels."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

# uvicorn re-raises the signal once its shutdown is complete, so the process ends as SIGTERM's default
# action would end it (status 143 in a shell, what service managers expect of a stop)
CLEAN_EXIT = (0, -signal.SIGTERM)


def stream_body(max_tokens: int) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_sigterm_during_a_stream_lets_it_finish_and_exits_cleanly(tmp_path, model_dir):
    with GatewayProcess({"CACHEGEN_STORE": "memory://"}, tmp_path / "gateway.log") as gw:
        events: list[str] = []
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=stream_body(40), timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            events.append(first)
            gw.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections once shutting down
                httpx.get(f"{gw.url}/health", timeout=5)
            events.extend(line for line in lines if line.startswith("data: "))
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 40  # every token was generated and sent
        assert any('"finish_reason":"length"' in e for e in events)
        assert gw.proc.wait(timeout=60) in CLEAN_EXIT
        assert "Application shutdown complete" in gw.log() and "Traceback" not in gw.log()


def test_past_the_grace_running_work_is_cancelled_and_no_half_context_is_listed(
    tmp_path, model_dir, tokenizer
):
    store = tmp_path / "store"
    env = {"CACHEGEN_STORE": f"file://{store}", "CACHEGEN_SHUTDOWN_GRACE_S": "1"}
    with GatewayProcess(env, tmp_path / "gateway.log") as gw:
        long_text = "A context that is still being encoded when the gateway is told to stop. " * 200
        ids = tokenizer(long_text)["input_ids"][:2000]
        outcome: dict[str, object] = {}

        def encode() -> None:
            try:
                outcome["status"] = httpx.post(
                    f"{gw.url}/contexts", json={"prompt_token_ids": ids}, timeout=120
                ).status_code
            except httpx.HTTPError as exc:
                outcome["error"] = type(exc).__name__

        encoder = threading.Thread(target=encode)
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=stream_body(2000), timeout=120) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            encoder.start()
            time.sleep(1.0)  # the encode is admitted and prefilling
            gw.proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            try:
                tail = [line for line in lines if line.startswith("data: ")]
            except httpx.HTTPError:
                tail = []  # the connection was cut
        encoder.join(timeout=60)
        assert gw.proc.wait(timeout=30) in CLEAN_EXIT
        assert "Application shutdown complete" in gw.log() and "Traceback" not in gw.log()
        assert time.monotonic() - stopped < 20  # the grace is 1 s, and the model stops at its next step
        assert "data: [DONE]" not in tail  # 2000 tokens could not finish within the grace
        assert outcome.get("status") == 503  # the encode was cancelled, and told why
    # the manifest is written last: an interrupted encode leaves none, so nothing is listed
    assert list(store.glob("contexts/**/*.json")) == []
