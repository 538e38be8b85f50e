"""Start-up as a process manager sees it: /health at once, /ready and the API once the model is loaded.

A fresh cache directory makes the gateway measure its cost profile, so the
loading phase lasts seconds and is seen by polling from the first moment the
port answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway_process import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def spawn(env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "CACHEGEN_LOG_LEVEL": "info", **env},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


def test_health_answers_while_the_model_loads_and_the_api_waits_for_it(tmp_path, model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "CACHEGEN_MODEL": str(model_dir),
        "CACHEGEN_CACHE_DIR": str(tmp_path / "cache"),
        "CACHEGEN_STORE": "memory://",
    }
    proc = spawn(env, port, tmp_path / "gateway.log")
    seen: list[tuple[str, int, int, str | None]] = []  # (health status, /ready, /v1/models, error code)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:  # asked in this order: a later answer may already be past the load, never before it
                health = httpx.get(f"{url}/health", timeout=5).json()["status"]
                ready = httpx.get(f"{url}/ready", timeout=5).status_code
                models = httpx.get(f"{url}/v1/models", timeout=5)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            code = None
            if models.status_code != 200:
                code = models.json()["error"]["code"]
                assert models.headers.get("retry-after") == "5"
            seen.append((health, ready, models.status_code, code))
            if health == "ok":
                break
            time.sleep(0.05)
        log = (tmp_path / "gateway.log").read_text()
        assert seen and seen[-1] == ("ok", 200, 200, None), (seen[-3:], log[-3000:])
        assert ("loading", 503, 503, "model_loading") in seen, (
            "the server answered only once the model was loaded"
        )
        for health, ready, models_status, _ in seen:
            if ready == 200:  # once ready, the API serves
                assert models_status == 200
            if health == "ok":
                assert ready == 200 and models_status == 200
        assert "start-up: the cost profile (measuring this machine)" in log
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=120,
        )
        assert chat.status_code == 200, chat.text
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_start_up_that_fails_stops_the_server_with_status_1(tmp_path):
    env = {"CACHEGEN_MODEL": "someorg/no-such-model", "HF_HUB_OFFLINE": "1", "CACHEGEN_STORE": "memory://"}
    proc = spawn(env, free_port(), tmp_path / "gateway.log")
    assert proc.wait(120) == 1
    log = (tmp_path / "gateway.log").read_text()
    assert "start-up failed: cannot load model 'someorg/no-such-model'" in log
    assert "Traceback" not in log  # a known failure is one line, as before the server started
