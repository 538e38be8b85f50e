"""Fuzzing a live gateway: schemathesis over its own /openapi.json, and hostile inputs by hand.

Schemathesis generates requests for every operation of the schema, valid and invalid (a bounded,
derandomized number per operation, so a run is the same every time), and checks each response:
no 5xx, every error an OpenAI error object, documented statuses, content types and bodies.
Generation stays cheap: generated requests ask for at most ``MAX_TOKENS`` tokens, and the
gateway's window (``CACHEGEN_MAX_MODEL_LEN``) caps whatever slips through.

The hand-written cases below it send what a schema-driven generator does not: lone surrogates,
raw JSON that Python's parser accepts (NaN), context ids that try to leave the store.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import checks as sc

from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

MAX_TOKENS = 4
WINDOW = 96  # tokens: the backstop on generation cost (prompt + max_tokens)
FUZZ_EXAMPLES = 20  # per operation, in the fuzzing phase; the coverage phase adds its own boundary cases
NEEDS_CONTENT = {"system", "developer", "user", "tool"}


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "escape.json").write_text("{}")  # a store key that leaves the store would reach this
    env = {
        "CACHEGEN_STORE": f"file://{root / 'store'}",
        "CACHEGEN_DEFAULT_MAX_TOKENS": str(MAX_TOKENS),
        "CACHEGEN_MAX_MODEL_LEN": str(WINDOW),
    }
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def sentinel(fuzz_gateway: GatewayProcess) -> Path:
    return fuzz_gateway.log_path.parent / "escape.json"


@pytest.fixture(scope="module")
def api_schema(fuzz_gateway: GatewayProcess):
    return schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json", timeout=30)


# -- checks -----------------------------------------------------------------------------------------


def assert_error_object(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


@schemathesis.check
def openai_error_object(ctx, response, case) -> None:
    """Every 4xx and 5xx body is ``{"error": {"message", "type", "param", "code"}}`` (a HEAD's has
    no body)."""
    if response.status_code >= 400 and case.method.upper() != "HEAD":
        assert_error_object(json.loads(response.content))


@schemathesis.check
def event_stream_framing(ctx, response, case) -> None:
    """An event stream is ``data: <JSON object>`` events ending in ``data: [DONE]``; an error inside
    it is an error object too."""
    if not is_event_stream(response):
        return
    events = [e for e in response.content.decode().split("\n\n") if e.strip()]
    assert events and events[-1] == "data: [DONE]", events[-3:]
    for event in events[:-1]:
        assert event.startswith("data: ") and "\n" not in event, event
        payload = json.loads(event.removeprefix("data: "))
        if "error" in payload:
            assert_error_object(payload)
        else:
            assert payload["object"] in ("chat.completion.chunk", "text_completion"), payload


def is_event_stream(response) -> bool:
    return response.headers.get("content-type", [""])[0].startswith("text/event-stream")


BASE_CHECKS = [sc.not_a_server_error, openai_error_object, event_stream_framing]
DOCUMENTED = [
    sc.status_code_conformance,
    sc.content_type_conformance,
    sc.response_schema_conformance,
    sc.response_headers_conformance,
    sc.unsupported_method,
]


def checks_for(case, response) -> list:
    if is_event_stream(response):
        return BASE_CHECKS  # /openapi.json documents JSON only; the framing check reads the stream
    if case.operation.path == "/metrics":
        return [*BASE_CHECKS, sc.status_code_conformance]  # documented as JSON, served as Prometheus text
    return [*BASE_CHECKS, *DOCUMENTED]


# -- schemathesis -----------------------------------------------------------------------------------


def steer(case) -> None:
    """Lead generated requests past the checks that would end them before the model runs, and keep
    generation cheap. Only what the schema says nothing about is changed, so a request the schema
    calls invalid stays invalid: the served model's name for any string ``model``, content for
    messages whose role needs it, and at most ``MAX_TOKENS`` tokens."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL_NAME
    if case.operation.path == "/v1/completions":
        body.setdefault("max_tokens", MAX_TOKENS)  # its default is 16; chat's is the gateway's, set above
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[key] = MAX_TOKENS
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict) or message.get("content") is not None:
                continue
            if isinstance(message.get("role"), str) and message["role"] in NEEDS_CONTENT:
                message["content"] = "Say hi."


# HEAD runs each GET's handler, and /v1/contexts* are the /contexts handlers: tests/integration/
# test_gateway_clients.py covers both, so the fuzzer spends its examples on the distinct operations
schema = (
    schemathesis.pytest.from_fixture("api_schema").exclude(method="HEAD").exclude(path_regex="^/v1/contexts")
)


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_openapi_fuzz(case) -> None:
    steer(case)
    response = case.call(timeout=120)
    case.validate_response(response, checks=checks_for(case, response))


# -- by hand: token ids, extension fields, raw JSON -------------------------------------------------


def post(gateway: GatewayProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=120)


def post_raw(gateway: GatewayProcess, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=120
    )


def assert_400(r: httpx.Response, param: str | None) -> dict:
    assert r.status_code == 400, r.text
    body = r.json()
    assert_error_object(body)
    assert body["error"]["param"] == param, body
    return body["error"]


def completion(**fields: Any) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1, **fields}


HOSTILE_IDS = [
    -1,
    -(2**63),
    2**63,
    2**64 + 1,
    10**30,
    True,
    False,
    1.0,
    1.5,
    "1",
    "",
    None,
    [1],
    [[]],
    {"id": 1},
]


@pytest.mark.parametrize("token", HOSTILE_IDS, ids=repr)
def test_hostile_token_ids_are_400_naming_the_field(fuzz_gateway, token):
    # [1, token]: a list holding one string is a text prompt
    assert_400(post(fuzz_gateway, "/v1/completions", completion(prompt=[1, token])), "prompt")
    assert_400(post(fuzz_gateway, "/contexts", {"prompt_token_ids": [1, token]}), "prompt_token_ids")
    r = post(fuzz_gateway, "/detokenize", {"tokens": [token]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tokens"), r.text


@pytest.mark.parametrize("key", ["-1", "1e3", " 12", "1_000", "١٢", "0x10", "", "9" * 30, "49152"], ids=repr)
def test_hostile_logit_bias_keys_are_400(fuzz_gateway, key):
    assert_400(post(fuzz_gateway, "/v1/completions", completion(logit_bias={key: 1})), "logit_bias")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_quality", ""),
        ("kv_quality", "lossless\x00"),
        ("kv_quality", "x" * 10_000),
        ("kv_quality", 5),
        ("kv_quality", None),
        ("kv_slo_ms", 0),
        ("kv_slo_ms", -1),
        ("kv_slo_ms", 1e308),
        ("kv_slo_ms", "fast"),
        ("cache_salt", ""),
        ("cache_salt", "s" * 257),
        ("cache_salt", 7),
        ("cache_salt", ["a"]),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_bad_extension_fields_are_400(fuzz_gateway, field, value):
    assert_400(post(fuzz_gateway, "/v1/completions", completion(**{field: value})), field)


@pytest.mark.parametrize("value", [0, -1, 2**70, "-10", 1.5, [], "forever", {"s": 1}], ids=repr)
def test_bad_ttl_seconds_are_400(fuzz_gateway, value):
    body = {"prompt_token_ids": [1] * 300, "ttl_seconds": value}
    assert_400(post(fuzz_gateway, "/contexts", body), "ttl_seconds")


def test_odd_extension_values_that_are_valid_are_served(fuzz_gateway):
    odd = {
        "kv_quality": "lossless",
        "kv_slo_ms": 1e-9,
        "cache_salt": "\u00e9\U0001f600" * 64,
        "seed": 2**63 - 1,
        "n": 2,  # choice 1 samples with seed + 1, past 2**63
        "logit_bias": {"0": -100, "00017": 100},
        "unknown": {"nested": [1, {"deep": None}], "big": 10**40, "float": 1e308},
        "x" * 200: "y",
    }
    r = post(fuzz_gateway, "/v1/completions", completion(**odd))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        # a lone surrogate is valid JSON and a Python str, but no tokenizer can encode it
        ("/v1/completions", b'{"model": "M", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"model": "M", "prompt": ["\\udfff"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
            "messages[0].name",
        ),
        ("/contexts", b'{"text": "\\ud800"}', "text"),
        # Python's JSON parser takes NaN and Infinity
        ("/v1/completions", b'{"model": "M", "prompt": "hi", "temperature": NaN}', "temperature"),
        ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": Infinity}', "max_tokens"),
        ("/v1/completions", b'{"model": "M", "prompt": "hi", "kv_slo_ms": -Infinity}', "kv_slo_ms"),
        ("/v1/completions", b'{"model": "M", "prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
        # what the parser refuses: too deep, too many digits, not UTF-8
        ("/v1/completions", b'{"model": "M", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        ("/v1/completions", b'{"model": "M", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
        ("/v1/completions", b'{"model": "M", "prompt": "\xff\xfe"}', None),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_raw_json_edge_cases_are_400(fuzz_gateway, path, raw, param):
    assert_400(post_raw(fuzz_gateway, path, raw.replace(b'"M"', json.dumps(MODEL_NAME).encode())), param)


def test_tokenize_refuses_a_lone_surrogate(fuzz_gateway):
    r = post_raw(fuzz_gateway, "/tokenize", b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert_400(r, "messages[0].content[0].text")


# -- by hand: context ids that try to leave the store ------------------------------------------------


def raw_request(gateway: GatewayProcess, method: str, raw_path: str) -> tuple[int, bytes, str | None]:
    """Send the path exactly as given: httpx would normalize dot segments and quote characters."""
    parts = urlsplit(gateway.url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        conn.putrequest(method, raw_path, skip_accept_encoding=True)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read(), response.getheader("location")
    finally:
        conn.close()


TRAVERSALS = [
    "..",
    "...",
    "../escape",
    "..%2Fescape",
    "..%2f..%2fescape",
    "%2e%2e%2fescape",
    "%2E%2E",
    "....%2F%2Fescape",
    "..%5Cescape",
    "%00",
    "abc%00.json",
    "%0d%0aX-Injected:%201",
    "%ff%fe",
    "%C0%AE%C0%AE%2Fescape",
    "escape.json",
    "a" * 4000,
    quote("\u202e\u0000\ud7ff\U0001f600", safe=""),
    quote("contexts/../../escape", safe=""),
]


@pytest.mark.parametrize("context_id", TRAVERSALS, ids=lambda v: v[:40])
@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_hostile_context_ids_are_404(fuzz_gateway, sentinel, method, context_id):
    status, body, _ = raw_request(fuzz_gateway, method, f"/contexts/{context_id}")
    assert status == 404, body
    assert_error_object(json.loads(body))
    assert sentinel.exists()


@pytest.mark.parametrize("context_id", ["..%2F", "%C0%AE%2F", "x%2F%2F"])
def test_a_trailing_slash_redirects_within_contexts(fuzz_gateway, sentinel, context_id):
    """Starlette's redirect_slashes: ``/contexts/../`` goes to ``/contexts/..``, never further up."""
    status, _, location = raw_request(fuzz_gateway, "DELETE", f"/contexts/{context_id}")
    assert status == 307 and location is not None
    assert urlsplit(location).path.startswith("/contexts/")
    assert sentinel.exists()


@given(
    context_id=st.text(st.characters(codec="utf-8"), min_size=1, max_size=300).filter(lambda s: s[-1] != "/")
)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
def test_any_context_id_is_a_404_error_object(fuzz_gateway, sentinel, context_id):
    for method in ("GET", "DELETE"):
        status, body, _ = raw_request(fuzz_gateway, method, "/contexts/" + quote(context_id, safe=""))
        assert status == 404, (context_id, status, body)
        assert_error_object(json.loads(body))
    assert sentinel.exists()


def test_nothing_was_written_outside_the_store(fuzz_gateway, sentinel):
    root = sentinel.parent
    outside = {p.name for p in root.iterdir()} - {"store", "gateway.log", "escape.json"}
    assert outside == set()
    assert sentinel.read_text() == "{}"
    assert "unhandled error" not in fuzz_gateway.log()


def test_no_500_in_the_whole_run(fuzz_gateway):
    """The metrics count every error response by status: after everything above, no 5xx."""
    time.sleep(0.2)
    text = httpx.get(f"{fuzz_gateway.url}/metrics", timeout=30).text
    server_errors = [
        line
        for line in text.splitlines()
        if line.startswith("cachegen:request_errors_total{")
        and 'status="5' in line
        and not line.endswith(" 0.0")
    ]
    assert server_errors == []
