"""Errors in the log and in /metrics: one line per 4xx, no traceback, counted by status and code;
request ids; the JSON log format; the field a context_length_exceeded names; validation messages."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

LONG_TEXT = "hello " * 9000  # past the default model's 8192-token window
# uvicorn logs these itself before the app starts, in its own format: ``python -m app`` runs
# uvicorn with its default log config, which the app can only take over at startup
UVICORN_PRESTART = ("Started server process", "Waiting for application startup")


def chat(**overrides) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(overrides)
    return body


def new_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def error_counts(url: str) -> dict[tuple[str, str], float]:
    """cachegen:request_errors_total by (status, code)."""
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("cachegen:request_errors_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
            counts[(labels["status"], labels["code"])] = float(line.rsplit(" ", 1)[1])
    return counts


def log_text(gw: GatewayProcess) -> str:
    return Path(gw.log_path).read_text(errors="replace")


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]


# Each case: method, path, request body, expected status, code and param.
ERRORS = [
    ("POST", "/v1/chat/completions", chat(model="gpt-4"), 404, "model_not_found", "model"),
    ("GET", "/contexts/ctx-00000000000000000000000000000000", None, 404, "context_not_found", "id"),
    ("POST", "/v1/chat/completions", chat(kv_quality="ultra"), 400, "invalid_request_error", "kv_quality"),
    (
        "POST",
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": [10**9], "max_tokens": 1},
        400,
        "invalid_request_error",
        "prompt",
    ),
    (
        "POST",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": LONG_TEXT}]),
        400,
        "context_length_exceeded",
        "messages",
    ),
    ("POST", "/v1/chat/completions", chat(stop=list("abcde")), 400, "invalid_request_error", "stop"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "code", "param"), ERRORS)
def test_error_is_one_log_line_and_counted(gateway, method, path, body, status, code, param):
    before = error_counts(gateway.url)
    rid = new_id()
    r = httpx.request(method, f"{gateway.url}{path}", json=body, headers={"x-request-id": rid}, timeout=120)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"] or err["type"], err["param"]) == (code, param)
    assert r.headers["x-request-id"] == rid

    text = log_text(gateway)
    assert_no_traceback(text)
    mine = [line for line in text.splitlines() if f"[{rid}]" in line]
    warnings = [line for line in mine if " WARNING " in line]
    assert len(warnings) == 1, mine
    assert f"{status} {code}: {err['message']}" in warnings[0]
    assert f"{method} {path}" in warnings[0]
    after = error_counts(gateway.url)
    assert after.get((str(status), code), 0) == before.get((str(status), code), 0) + 1


def test_request_id_is_generated_unless_sane(gateway):
    r = httpx.get(f"{gateway.url}/health")
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    for bad in ("has spaces", "x" * 200, "semi;colon"):
        r = httpx.get(f"{gateway.url}/health", headers={"x-request-id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), bad
    assert (
        httpx.get(f"{gateway.url}/health", headers={"x-request-id": "a.b:c-1_2"}).headers["x-request-id"]
        == "a.b:c-1_2"
    )


# -- context_length_exceeded names the request's own field ------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": LONG_TEXT, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": [1] * 9000, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 9000}, "max_tokens"),
        ("/v1/chat/completions", chat(max_tokens=9000), "max_tokens"),
        ("/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=9000), "max_completion_tokens"),
        ("/contexts", {"text": LONG_TEXT}, "text"),
        ("/contexts", {"messages": [{"role": "system", "content": LONG_TEXT}]}, "messages"),
        ("/contexts", {"prompt_token_ids": [1] * 9000}, "prompt_token_ids"),
    ],
)
def test_context_length_param(gateway, path, body, param):
    r = httpx.post(f"{gateway.url}{path}", json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", param), err


# -- validation messages name the constraint ------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "kwargs", "message", "param"),
    [
        (
            "/v1/chat/completions",
            {"json": chat(stop=list("abcde"))},
            "stop: at most 4 stop sequences",
            "stop",
        ),
        (
            "/v1/chat/completions",
            {"json": chat(stop=5)},
            "stop: must be a string or a list of strings",
            "stop",
        ),
        (
            "/v1/completions",
            {"json": {"model": MODEL_NAME, "prompt": [5, -1]}},
            "prompt: token ids must be >= 0",
            "prompt",
        ),
        (
            "/v1/completions",
            {"json": {"model": MODEL_NAME, "prompt": ["a", "b"]}},
            "prompt: only one prompt per request is supported",
            "prompt",
        ),
        ("/v1/chat/completions", {}, "request body is empty; expected a JSON object", None),
        ("/v1/chat/completions", {"json": [1, 2]}, "request body must be a JSON object", None),
        (
            "/v1/chat/completions",
            {"json": chat(messages=[{"role": "user", "content": None}])},
            "messages[0].content: a user message needs content",
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"json": chat(messages=[{"role": "system", "content": "x"}, {"role": "user"}])},
            "messages[1].content: a user message needs content",
            "messages[1].content",
        ),
        (
            "/v1/chat/completions",
            {"json": chat(messages=[{"role": "user", "content": 7}])},
            "messages[0].content: must be a string or a list of content parts",
            "messages[0].content",
        ),
        (
            "/contexts",
            {"json": {"prompt_token_ids": [1, -2]}},
            "prompt_token_ids: token ids must be >= 0",
            "prompt_token_ids",
        ),
    ],
)
def test_validation_messages(gateway, path, kwargs, message, param):
    r = httpx.post(f"{gateway.url}{path}", timeout=60, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["message"], err["param"], err["type"]) == (message, param, "invalid_request_error")


def test_assistant_message_may_have_no_content(gateway):
    body = chat(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ]
    )
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text


# -- JSON log format, and 429 ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("gateway-json")
    env = {
        "CACHEGEN_STORE": f"file://{root / 'store'}",
        "CACHEGEN_LOG_FORMAT": "JSON",
        "CACHEGEN_LOG_LEVEL": "INFO",
        "CACHEGEN_MAX_QUEUE": "1",
    }
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


def json_records(gw: GatewayProcess) -> list[dict]:
    records = []
    for line in log_text(gw).splitlines():
        if not line.strip() or any(s in line for s in UVICORN_PRESTART):
            continue
        records.append(json.loads(line))  # every other line is one JSON object
    return records


def test_json_log_lines_carry_the_request_id(json_gateway):
    rid = new_id()
    r = httpx.post(
        f"{json_gateway.url}/v1/chat/completions", json=chat(model="gpt-4"), headers={"x-request-id": rid}
    )
    assert r.status_code == 404 and r.headers["x-request-id"] == rid
    records = json_records(json_gateway)
    assert any(rec["message"].startswith("serving ") for rec in records)  # start-up lines too
    # every start-up stage says when it starts and how long it took
    stages = [rec["message"] for rec in records if rec["message"].startswith("start-up: ")]
    for stage in ("loading the model", "content digest", "KV store", "compiling the codec", "cost profile"):
        assert any(stage in m and m.endswith(" ...") for m in stages), (stage, stages)
        assert any(stage in m and re.search(r"done in \d+\.\d s$", m) for m in stages), (stage, stages)
    mine = [rec for rec in records if rec.get("request_id") == rid]
    errors = [rec for rec in mine if rec["level"] == "warning"]
    assert len(errors) == 1, mine
    assert (errors[0]["status"], errors[0]["code"], errors[0]["path"]) == (
        404,
        "model_not_found",
        "/v1/chat/completions",
    )
    assert any(rec["logger"] == "uvicorn.access" for rec in mine)  # uvicorn's access line has it too
    assert not any("exc_info" in rec for rec in records)


def test_429_is_one_line_and_counted(json_gateway):
    url = json_gateway.url
    before = error_counts(url)
    body = chat(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()  # kept: a dropped iterator closes the stream, and frees the slot
        assert next(lines).startswith("data: ")  # admitted: the one slot is taken
        rid = new_id()
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(), headers={"x-request-id": rid}, timeout=60)
    assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    mine = [rec for rec in json_records(json_gateway) if rec.get("request_id") == rid]
    assert [rec["code"] for rec in mine if rec["level"] == "warning"] == ["rate_limit_exceeded"]
    assert_no_traceback(log_text(json_gateway))
    assert (
        error_counts(url).get(("429", "rate_limit_exceeded"), 0)
        == before.get(("429", "rate_limit_exceeded"), 0) + 1
    )
