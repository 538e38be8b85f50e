"""Request validation of the API models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.protocol import ChatCompletionRequest, CompletionRequest, ContextRequest

MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_aliases():
    r = ChatCompletionRequest(model="m", messages=MSG, max_completion_tokens=5)
    assert r.requested_max_tokens() == 5 and r.kv_cache and r.kv_quality == "auto"
    assert ChatCompletionRequest(model="m", messages=MSG).requested_max_tokens() is None


@pytest.mark.parametrize(
    "extra",
    [
        {"messages": []},
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"top_p": 1.5},
        {"n": 3},
        {"stop": ""},
        {"stop": ["a", ""]},
        {"max_tokens": 3, "max_completion_tokens": 4},
    ],
)
def test_chat_rejects(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**{"model": "m", "messages": MSG, **extra})


def test_content_parts_are_joined():
    r = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
    )
    assert r.messages[0].text() == "ab"


def test_completion_prompt_forms():
    assert CompletionRequest(model="m", prompt=["only"]).prompt == "only"
    assert CompletionRequest(model="m", prompt=[1, 2]).prompt == [1, 2]
    assert CompletionRequest(model="m", prompt="x", echo=True, max_tokens=0).max_tokens == 0
    for bad in ({"prompt": ["a", "b"]}, {"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": [-1]}):
        with pytest.raises(ValidationError):
            CompletionRequest(model="m", **bad)


def test_context_request_needs_exactly_one_source():
    assert ContextRequest(text="abc").text == "abc"
    for bad in ({}, {"text": "a", "prompt_token_ids": [1]}, {"text": ""}, {"prompt_token_ids": []}):
        with pytest.raises(ValidationError):
            ContextRequest(**bad)
