"""``benchmarks/load_test.py`` as users run it: a subprocess against a deployment, checked through its JSON.

Two runs against the session gateway (short prompts; one shared pre-encoded
context) and one against a stub server that checks the API key header and
how rejections, errors and a stream without usage are counted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tests.gateway_process import REPO

pytestmark = pytest.mark.slow

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_tool(url: str, out: Path, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load_test", "--url", url, "--out", str(out), *args],
        cwd=REPO,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Serving Benchmark Result" in proc.stdout
    return json.loads(out.read_text())


def assert_distributions_ordered(summary: dict[str, Any]) -> None:
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = summary[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
    assert summary["ttft_ms"]["p99"] <= summary["e2e_ms"]["p99"]


def test_short_prompts_count_exactly_max_tokens(gateway, tmp_path):
    out = tmp_path / "short.json"
    result = run_tool(
        gateway.url, out, "--short-prompts", "--requests", "6", "--concurrency", "2",
        "--max-tokens", "8", "--ignore-eos", "--slo-ttft-ms", "60000",
    )  # fmt: skip
    assert set(result) == {"config", "contexts", "summary", "requests"}
    summary, records = result["summary"], result["requests"]
    assert result["config"]["model"] == "SmolLM2-135M-Instruct" and result["config"]["api_key"] is None
    assert summary["requests_completed"] == 6 and summary["errors"] == {}
    assert summary["requests_rejected"] == 0 and summary["peak_in_flight"] <= 2
    assert [r["output_tokens"] for r in records] == [8] * 6
    assert all(r["output_tokens_from"] == "usage" and r["prompt_tokens"] > 0 for r in records)
    assert summary["total_output_tokens"] == 48 and summary["output_token_throughput"] > 0
    assert all(r["ttft_ms"] <= r["e2e_ms"] for r in records)
    assert_distributions_ordered(summary)
    assert summary["slo"]["attainment"] == 1.0
    assert out.with_suffix(".png").is_file() == HAVE_MATPLOTLIB


def test_shared_context_is_pre_encoded_and_reused(gateway, tmp_path):
    out = tmp_path / "context.json"
    result = run_tool(
        gateway.url, out, "--num-contexts", "1", "--context-tokens", "600", "--encode-levels", "lossless",
        "--requests", "3", "--concurrency", "3", "--max-tokens", "4", "--ignore-eos", "--no-plot",
    )  # fmt: skip
    (context,) = result["contexts"]
    assert context["tokens"] >= 600 and context["cached_tokens"] >= 512
    summary, records = result["summary"], result["requests"]
    assert summary["requests_completed"] == 3 and summary["errors"] == {}
    assert [r["output_tokens"] for r in records] == [4] * 3
    assert all(r["context"] == 0 and r["cached_tokens"] >= 512 for r in records)
    assert summary["kv_cache_info"]["cached_tokens"] == summary["total_cached_tokens"]
    assert_distributions_ordered(summary)
    assert not out.with_suffix(".png").exists()


class StubHandler(BaseHTTPRequestHandler):
    """Chat requests cycle through: 429; 500; a stream that starts, then reports a rate-limit error;
    a stream of three content chunks and no usage."""

    protocol_version = "HTTP/1.1"
    seen_auth: ClassVar[list[str | None]] = []
    calls: ClassVar[int] = 0

    def do_GET(self) -> None:
        self.reply(200, "application/json", json.dumps({"data": [{"id": "stub-model"}]}))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        cls = type(self)
        cls.seen_auth.append(self.headers.get("Authorization"))
        cls.calls += 1
        if cls.calls % 4 == 1:
            self.reply(429, "application/json", '{"error": {"message": "busy"}}')
        elif cls.calls % 4 == 2:
            self.reply(500, "application/json", '{"error": {"message": "boom"}}')
        elif cls.calls % 4 == 3:
            error = {"error": {"message": "busy", "type": "rate_limit_error", "code": "rate_limit_exceeded"}}
            self.reply(200, "text/event-stream", f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n")
        else:
            chunks = [{"choices": [{"delta": {"content": w}}]} for w in ("a", "b", "c")]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self.reply(200, "text/event-stream", body)

    def reply(self, status: int, content_type: str, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stub_url() -> Iterator[str]:
    StubHandler.seen_auth, StubHandler.calls = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_api_key_rejections_and_errors_against_a_stub(stub_url, tmp_path):
    out = tmp_path / "stub.json"
    result = run_tool(
        stub_url, out, "--api-key", "sk-test", "--short-prompts", "--requests", "8",
        "--concurrency", "1", "--max-tokens", "8", "--no-plot",
    )  # fmt: skip
    assert StubHandler.seen_auth == ["Bearer sk-test"] * 8
    assert "sk-test" not in out.read_text() and result["config"]["api_key"] == "set"
    summary = result["summary"]
    assert result["config"]["model"] == "stub-model"
    assert summary["requests_rejected"] == 4 and summary["errors"] == {"500": 2}
    ok = [r for r in result["requests"] if r["status"] == 200 and r["error"] is None]
    assert summary["requests_completed"] == len(ok) == 2 and summary["total_output_tokens"] == 6
    assert all(r["output_tokens_from"] == "chunks" and len(r["itl_ms"]) == 2 for r in ok)
