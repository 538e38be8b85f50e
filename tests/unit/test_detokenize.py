"""Incremental detokenization with stop strings, on the default model's real tokenizer."""

from __future__ import annotations

import pytest

from engine.detokenize import IncrementalText


def stream(tokenizer, text: str, stops: list[str]) -> tuple[str, bool]:
    inc = IncrementalText(tokenizer, stops)
    out = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        out.append(inc.push(token))
        if inc.stopped:
            break
    out.append(inc.finish())
    return "".join(out), inc.stopped


@pytest.mark.parametrize(
    "text",
    ["Hello, world! How are you?", "naïve café — 東京 🙂 done", "   leading spaces\nand\ttabs"],
)
def test_deltas_add_up_to_the_text(tokenizer, text):
    assert stream(tokenizer, text, []) == (text, False)


def test_stop_string_is_cut_and_never_emitted(tokenizer):
    text, stopped = stream(tokenizer, "one two three four five", ["three"])
    assert stopped and text == "one two "


def test_stop_string_spanning_tokens(tokenizer):
    text, stopped = stream(tokenizer, "alpha beta<END>gamma", ["<END>"])
    assert stopped and text == "alpha beta"


def test_partial_stop_is_released_at_the_end(tokenizer):
    text, stopped = stream(tokenizer, "wait for it <EN", ["<END>"])
    assert not stopped and text == "wait for it <EN"
