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
        {"n": 0},
        {"n": 9},
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"5": 101}},
        {"logit_bias": {"-1": 1}},
        {"top_logprobs": 2},  # without logprobs: true
        {"logprobs": True, "top_logprobs": 21},
        {"stop": ""},
        {"stop": ["a", ""]},
        {"max_tokens": 3, "max_completion_tokens": 4},
    ],
)
def test_chat_rejects(extra):
    with pytest.raises(ValidationError):
        ChatCompletionRequest(**{"model": "m", "messages": MSG, **extra})


def test_unsupported_parameters_are_named():
    def refused(**extra):
        return ChatCompletionRequest(model="m", messages=MSG, **extra).unsupported()

    assert refused() is None
    assert refused(response_format={"type": "text"}) is None and refused(tool_choice="none") is None
    assert refused(tools=[{"type": "function", "function": {"name": "f"}}])[0] == "tools"
    assert refused(tool_choice="auto")[0] == "tool_choice"
    assert refused(response_format={"type": "json_object"})[0] == "response_format"


def test_unknown_fields_are_kept_aside_to_be_named():
    r = ChatCompletionRequest(model="m", messages=MSG, best_of=2, guided_json={})
    assert r.ignored_fields() == ["best_of", "guided_json"]
    assert ChatCompletionRequest(model="m", messages=MSG).ignored_fields() == []


def test_logit_bias_keys_become_token_ids():
    r = ChatCompletionRequest(model="m", messages=MSG, logit_bias={"5": -100, "7": 2.5})
    assert r.logit_bias == {5: -100.0, 7: 2.5}


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


def test_the_routers_default_fields_are_not_named_as_ignored():
    routed = CompletionRequest(
        model="m", prompt="hi", no_stop_trim=False, skip_special_tokens=True, return_hidden_states=False
    )
    assert routed.ignored_fields() == []
    asked = CompletionRequest(model="m", prompt="hi", skip_special_tokens=False, frobnicate=1)
    assert asked.ignored_fields() == ["frobnicate", "skip_special_tokens"]
