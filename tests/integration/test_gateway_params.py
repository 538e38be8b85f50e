"""Sampling and response parameters through a real gateway: implemented exactly, or refused by name."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **{"max_tokens": 6, **kwargs})


def test_chat_logprobs_and_top_logprobs(client):
    out = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(entry.token for entry in content) == out.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)


def test_streamed_chat_logprobs(client):
    stream = chat(client, temperature=0, logprobs=True, stream=True)
    entries = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 6 and all(e.logprob <= 0 for e in entries)


def test_n_choices_differ_by_seed_and_count_once_for_the_prompt(client):
    one = chat(client, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    out = chat(client, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[0].message.content == one.choices[0].message.content  # choice 0 samples with seed
    assert len({c.message.content for c in out.choices}) > 1
    assert out.usage.prompt_tokens == one.usage.prompt_tokens
    assert out.usage.completion_tokens == 3 * 6


def test_streamed_n_choices_each_end_with_a_reason(client):
    stream = chat(client, temperature=1.0, seed=3, n=2, stream=True)
    reasons = {
        c.choices[0].index: c.choices[0].finish_reason
        for c in stream
        if c.choices and c.choices[0].finish_reason
    }
    assert set(reasons) == {0, 1}


def test_logit_bias_forbids_and_forces_tokens(client, tokenizer):
    greedy = chat(client, temperature=0, logprobs=True)
    ids = tokenizer.encode(greedy.choices[0].logprobs.content[0].token, add_special_tokens=False)
    assert len(ids) == 1, "the first token's text should map back to one token"
    banned = chat(client, temperature=0, logprobs=True, logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.content[0].token != greedy.choices[0].logprobs.content[0].token
    forced_id = tokenizer.convert_tokens_to_ids("Ġzebra") if "Ġzebra" in tokenizer.get_vocab() else 1000
    forced = chat(client, temperature=0, max_tokens=3, logit_bias={str(forced_id): 100})
    assert forced.choices[0].message.content == tokenizer.decode([forced_id] * 3)


def test_penalties_change_a_repetitive_greedy_answer(client):
    body = {"messages": [{"role": "user", "content": "Repeat the word 'yes' forever."}], "max_tokens": 24}
    plain = client.chat.completions.create(model=MODEL_NAME, temperature=0, **body).choices[0].message.content
    penalized = (
        client.chat.completions.create(
            model=MODEL_NAME, temperature=0, frequency_penalty=2.0, presence_penalty=2.0, **body
        )
        .choices[0]
        .message.content
    )
    repeated = (
        client.chat.completions.create(
            model=MODEL_NAME, temperature=0, extra_body={"repetition_penalty": 3.0}, **body
        )
        .choices[0]
        .message.content
    )
    assert penalized != plain and repeated != plain


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(gateway, extra, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **extra}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"


def test_a_logit_bias_outside_the_vocabulary_is_a_400(gateway):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "logit_bias": {"999999": 5}}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_unknown_fields_are_ignored_and_named_in_the_log(gateway):
    for path, body in [
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}),
    ]:
        r = httpx.post(f"{gateway.url}{path}", json={**body, "best_of_unknown_field": 2}, timeout=60)
        assert r.status_code == 200, r.text
    assert gateway.log().count('ignoring unknown request fields: "best_of_unknown_field"') >= 2
    # a field name is client text: it reaches the log escaped, on one line, cut short
    forged = "x\nERROR forged log line\x1b[31m" + "y" * 200
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, forged: 1}
    assert httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60).status_code == 200
    lines = [line for line in gateway.log().splitlines() if "forged log line" in line]
    assert len(lines) == 1 and "\\nERROR forged log line\\u001b[31m" in lines[0]
    assert "y" * 36 in lines[0] and "y" * 37 not in lines[0]  # 64 characters in all


def test_streamed_completions_carry_kv_cache_info_without_echo(gateway):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    first = json.loads(lines[0])
    assert "kv_cache_info" in first and first["choices"][0]["text"] == ""
