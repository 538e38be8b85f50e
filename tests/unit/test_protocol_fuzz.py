"""Hostile input to the request models, the error mapping and the context id -> storage key path.

Whatever a client sends, validation either builds a request the later layers can use as it is
(token ids inside uint32, strings a tokenizer can encode, samplable parameters) or raises
pydantic's ``ValidationError``, which the app answers as a 400 error object; any other exception
would be a 500. A context id either names a manifest under ``contexts/`` or is refused before the
store is asked.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from app.errors import InvalidRequest, _validation_message, error_body, error_response
from app.protocol import (
    GREEDY_BELOW,
    MAX_TOKEN_ID,
    MAX_TTL_SECONDS,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
    ChatCompletionRequest,
    CompletionRequest,
    ContextRequest,
)
from scheduler.contexts import ContextStore
from scheduler.errors import ContextNotFound
from scheduler.layout import MANIFEST_PREFIX, manifest_key
from scheduler.prefix import CONTEXT_ID_PATTERN, Fingerprint
from storage.base import DEFAULT_LIMIT, check_key
from storage.local import LocalStore
from storage.memory import MemoryStore

# derandomized: the same examples on every run, so a failure is never a one-off
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None)
WHOLE = settings(FUZZ, max_examples=100, suppress_health_check=[HealthCheck.too_slow])

MODEL = "m"
MSG = [{"role": "user", "content": "hi"}]

# -- strategies -------------------------------------------------------------------------------------

surrogates = st.integers(0xD800, 0xDFFF).map(chr)
hostile_chars = st.one_of(
    st.characters(),  # any code point but surrogates: controls, NUL, RTL marks, astral planes
    surrogates,  # valid in JSON ("\ud800") and in a Python str, not in UTF-8
    st.sampled_from("/\\.%\x00\n\r\t :?#*\u202e\ufeff"),
)
hostile_text = st.text(hostile_chars, max_size=40)
huge_ints = st.one_of(st.integers(min_value=2**32), st.integers(min_value=2**63, max_value=2**300))
numbers = st.one_of(
    st.integers(),
    huge_ints,
    st.integers(max_value=-(2**63)),
    st.floats(),  # NaN and infinities included: Python's JSON parser takes them
)
json_scalars = st.one_of(st.none(), st.booleans(), numbers, hostile_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=12,
)
hostile_token_ids = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=MAX_TOKEN_ID + 1),
    huge_ints,
    st.booleans(),
    st.floats(),
    hostile_text,
    st.none(),
    st.lists(st.integers(0, 10), max_size=3),  # nested lists
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
token_ids = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=20)


def fields_of(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any of the model's fields (and unknown ones), each holding any JSON value."""
    names = st.one_of(st.sampled_from(sorted(model.model_fields)), hostile_text)
    return st.dictionaries(names, json_values, max_size=6)


BASES: dict[type[BaseModel], dict[str, Any]] = {
    ChatCompletionRequest: {"model": MODEL, "messages": MSG},
    CompletionRequest: {"model": MODEL, "prompt": "hi"},
    ContextRequest: {"text": "hi"},
}

# -- token ids --------------------------------------------------------------------------------------


@FUZZ
@given(token=hostile_token_ids, at=st.integers(0, 2))
def test_hostile_token_ids_are_validation_errors(token, at):
    ids = [1, 2]
    ids.insert(at, token)  # never alone: a list holding one string is a text prompt
    with pytest.raises(ValidationError):
        CompletionRequest(model=MODEL, prompt=ids)
    with pytest.raises(ValidationError):
        ContextRequest(prompt_token_ids=ids)
    with pytest.raises(ValidationError):
        ContextRequest(prompt_token_ids=[token])


@FUZZ
@given(ids=token_ids)
def test_token_ids_in_range_are_kept_as_they_are(ids):
    assert CompletionRequest(model=MODEL, prompt=ids).prompt == ids
    assert ContextRequest(prompt_token_ids=ids).prompt_token_ids == ids


@FUZZ
@given(key=st.one_of(hostile_text, st.from_regex(r"[0-9]{21,30}", fullmatch=True), huge_ints.map(str)))
def test_logit_bias_keys_are_plain_decimal_token_ids(key):
    plain = re.fullmatch(r"[0-9]{1,20}", key) is not None and int(key) <= MAX_TOKEN_ID
    try:
        request = CompletionRequest(model=MODEL, prompt="hi", logit_bias={key: 1})
    except ValidationError:
        assert not plain
    else:
        assert plain and request.logit_bias == {int(key): 1.0}


@FUZZ
@given(bias=json_values)
def test_logit_bias_values_are_finite_numbers_in_range(bias):
    try:
        request = CompletionRequest(model=MODEL, prompt="hi", logit_bias={"5": bias})
    except ValidationError:
        return
    (value,) = request.logit_bias.values()  # type: ignore[union-attr]
    assert math.isfinite(value) and -100 <= value <= 100


# -- whole requests ---------------------------------------------------------------------------------


def assert_usable(request: BaseModel) -> None:
    """What the serving layer takes for granted about a validated request."""
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(request, name, None)
        assert value is None or math.isfinite(value)
    if isinstance(request, ChatCompletionRequest | CompletionRequest):
        assert request.temperature == 0.0 or request.temperature >= GREEDY_BELOW
        assert request.top_p >= MIN_TOP_P
        assert request.repetition_penalty >= MIN_REPETITION_PENALTY
        assert request.seed is None or -(2**63) <= request.seed < 2**63
        assert request.kv_slo_ms is None or (math.isfinite(request.kv_slo_ms) and request.kv_slo_ms > 0)
        assert isinstance(request.kv_quality, str)
        for token, bias in (request.logit_bias or {}).items():
            assert 0 <= token <= MAX_TOKEN_ID and -100 <= bias <= 100
        assert all(isinstance(s, str) and s for s in request.stop_list())
    texts: list[str] = []
    if isinstance(request, ChatCompletionRequest) or getattr(request, "messages", None):
        texts += [m.text() for m in request.messages or []]  # type: ignore[union-attr]
        texts += [m.name for m in request.messages or [] if m.name]  # type: ignore[union-attr]
    prompt = getattr(request, "prompt", None) or getattr(request, "text", None)
    if isinstance(prompt, str):
        texts.append(prompt)
    elif prompt is not None:
        assert all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt)
    for text in texts:
        text.encode("utf-8")  # what the tokenizer needs
    if isinstance(request, ContextRequest):
        assert request.ttl_seconds is None or 1 <= request.ttl_seconds <= MAX_TTL_SECONDS
        assert request.cache_salt is None or 1 <= len(request.cache_salt) <= 256
    assert all(isinstance(name, str) for name in request.ignored_fields())  # type: ignore[attr-defined]


def assert_answerable(exc: ValidationError) -> None:
    """The app turns the error into a 400 body that renders (no lone surrogate reaches the JSON)."""
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
    message, param = _validation_message(RequestValidationError(errors))
    assert isinstance(message, str) and message
    assert param is None or isinstance(param, str)
    response = error_response(InvalidRequest(message, param=param))
    assert response.status_code == 400 and response.body


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
@WHOLE
@given(data=st.data())
def test_any_json_object_validates_or_is_a_validation_error(model, data):
    extra = data.draw(fields_of(model))
    body = {**BASES[model], **extra} if data.draw(st.booleans()) else extra
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        assert_answerable(exc)
    else:
        assert_usable(request)


@FUZZ
@given(text=hostile_text.filter(bool))
def test_text_that_utf8_cannot_hold_is_refused_where_it_would_be_tokenized(text):
    try:
        text.encode("utf-8")
        encodable = True
    except UnicodeEncodeError:
        encodable = False
    attempts = [
        lambda: CompletionRequest(model=MODEL, prompt=text),
        lambda: CompletionRequest(model=MODEL, prompt=[text]),
        lambda: ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": text}]),
        lambda: ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x", "name": text}]),
        lambda: ContextRequest(text=text),
    ]
    for attempt in attempts:
        if encodable:
            attempt()
        else:
            with pytest.raises(ValidationError, match="lone surrogate"):
                attempt()


@pytest.mark.parametrize(
    ("field", "value", "kept"),
    [
        ("temperature", 5e-324, 0.0),  # greedy: dividing the logits by it overflowed them
        ("temperature", 1e-6, 0.0),
        ("temperature", 1e-5, 1e-5),
        ("top_p", 5e-324, MIN_TOP_P),  # float32 rounded it to 0: no token was kept
        ("top_p", 0.5, 0.5),
        ("seed", 2**63 - 1, 2**63 - 1),
        ("seed", -(2**63), -(2**63)),
    ],
)
def test_sampling_parameters_that_broke_the_sampler_are_normalized(field, value, kept):
    assert getattr(CompletionRequest(model=MODEL, prompt="hi", **{field: value}), field) == kept


@pytest.mark.parametrize(
    ("field", "value"),
    [("repetition_penalty", 5e-324), ("repetition_penalty", 0.009), ("seed", 2**63), ("seed", -(2**63) - 1)],
)
def test_sampling_parameters_out_of_range_are_refused(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest(model=MODEL, prompt="hi", **{field: value})


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest], ids=lambda m: m.__name__)
@WHOLE
@given(data=st.data())
def test_one_odd_field_validates_or_is_rejected_cleanly(model, data):
    """Extension fields (kv_quality, kv_slo_ms, cache_salt), every other field, and unknown ones."""
    field = data.draw(st.one_of(st.sampled_from(sorted(model.model_fields)), hostile_text), label="field")
    value = data.draw(json_values, label="value")
    try:
        request = model.model_validate({**BASES[model], field: value})
    except ValidationError as exc:
        assert_answerable(exc)
    else:
        assert_usable(request)


@WHOLE
@given(value=json_values, salt=json_values)
def test_context_ttl_and_salt_validate_or_reject_cleanly(value, salt):
    try:
        request = ContextRequest.model_validate({"text": "hi", "ttl_seconds": value, "cache_salt": salt})
    except ValidationError as exc:
        assert_answerable(exc)
    else:
        assert_usable(request)


def test_error_bodies_render_whatever_the_message():
    body = error_response(InvalidRequest(f"bad {chr(0xD800)!r} \x00 \u202e", param="x")).body
    assert b"\\ud800" in body
    assert error_body("m", "t", None, None) == {
        "error": {"message": "m", "type": "t", "param": None, "code": None}
    }


# -- context ids and storage keys -------------------------------------------------------------------

hostile_ids = st.one_of(
    hostile_text,
    st.from_regex(CONTEXT_ID_PATTERN, fullmatch=True),
    st.from_regex(r"ctx-[0-9a-f]{32}", fullmatch=True).map(lambda s: s + "\n"),
    st.from_regex(r"ctx-[0-9a-f]{32}", fullmatch=True).flatmap(
        lambda s: st.sampled_from([f"../{s}", f"{s}/..", f"{s}/../../x", f"/{s}", f"{s}%2F..", f"{s}\x00"])
    ),
    st.sampled_from(["..", ".", "", "/", "../../escape", "contexts/../..", "%2e%2e", "\\..\\"]),
)


class RecordingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def get(self, key: str, limit: int = DEFAULT_LIMIT) -> bytes:
        self.keys.append(key)
        return super().get(key, limit)

    def head(self, key: str):  # type: ignore[no-untyped-def]
        self.keys.append(key)
        return super().head(key)

    def delete(self, key: str) -> None:
        self.keys.append(key)
        super().delete(key)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(2) as p:
        yield p


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(context_id=hostile_ids)
def test_a_context_id_reads_only_its_manifest_under_contexts(pool, context_id):
    store = RecordingStore()
    contexts = ContextStore(store, Fingerprint(b"\0" * 32), "m", 256, pool)
    for call in (contexts.get, contexts.delete):
        with pytest.raises(ContextNotFound):
            call(context_id)
    if re.fullmatch(CONTEXT_ID_PATTERN, context_id) is None:
        assert store.keys == []  # refused before the store was asked
    else:
        key = manifest_key(context_id)
        assert store.keys and set(store.keys) == {key}
        assert check_key(key) == key and key.startswith(MANIFEST_PREFIX) and key.count("/") == 2


@settings(FUZZ, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.one_of(
        hostile_text, st.lists(st.sampled_from(["a", "..", ".", "", "b.c", "%2F", "\x00"])).map("/".join)
    )
)
def test_check_key_accepts_only_keys_that_stay_inside_a_directory(tmp_path_factory, key):
    root = tmp_path_factory.getbasetemp() / "check-key-root"
    try:
        check_key(key)
    except ValueError:
        with pytest.raises(ValueError):
            LocalStore(root).put(key, b"x")
        return
    assert not key.startswith("/") and ".." not in key.split("/")
    resolved = (Path(root).resolve() / key).resolve()
    assert resolved.is_relative_to(Path(root).resolve()) and resolved != Path(root).resolve()
    assert re.fullmatch(r"[A-Za-z0-9._/-]+", key)
