"""Text made off the model thread: deltas, stop strings and logprob strings, on the real tokenizer."""

from __future__ import annotations

import asyncio

from scheduler.generation import Finished, PrefixReport, PromptDone, TokenEvent, TokenLogprob
from scheduler.text_stream import TextStream


class FakeEvents:
    """What the model thread would emit, in order; records whether the consumer closed it."""

    def __init__(self, events: list) -> None:
        self._events = list(events)
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.closed or not self._events:
            raise StopAsyncIteration
        return self._events.pop(0)

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.close()


def read(stream: TextStream) -> list:
    async def go():
        return [event async for event in stream]

    return asyncio.run(go())


def token_events(tokenizer, text: str) -> list[TokenEvent]:
    return [TokenEvent(t, None) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def report() -> PrefixReport:
    return PrefixReport(0, 3, [], 0.0, 0.0, [])


def test_tokens_get_their_text_and_the_tail_comes_with_the_end(tokenizer):
    text = "Hello, world! 東京 🙂 done"
    tokens = token_events(tokenizer, text)
    events = FakeEvents([PromptDone(report(), None), *tokens, Finished("length", len(tokens))])
    out = read(TextStream(events, tokenizer, ["never"]))
    assert isinstance(out[0], PromptDone) and isinstance(out[-1], Finished)
    assert out[-1].reason == "length" and out[-1].completion_tokens == len(tokens)
    assert "".join(e.text for e in out if isinstance(e, TokenEvent)) + out[-1].text_tail == text


def test_a_stop_string_ends_the_stream_and_cancels_the_generation(tokenizer):
    tokens = token_events(tokenizer, "one two three four five six")
    events = FakeEvents([PromptDone(report(), None), *tokens, Finished("length", len(tokens))])
    out = read(TextStream(events, tokenizer, ["three"]))
    delivered = [e for e in out if isinstance(e, TokenEvent)]
    end = out[-1]
    assert isinstance(end, Finished) and end.reason == "stop" and end.text_tail == ""
    assert "".join(e.text for e in delivered) == "one two "
    # the tokens up to the one that completed the stop string, nothing after it
    upto = len(tokenizer("one two three", add_special_tokens=False)["input_ids"])
    assert end.completion_tokens == len(delivered) == upto
    assert events.closed  # the model thread drops the generation at its next step


def test_an_abort_releases_no_held_text(tokenizer):
    tokens = token_events(tokenizer, "wait for it <EN")
    out = read(TextStream(FakeEvents([*tokens, Finished("abort", len(tokens))]), tokenizer, ["<END>"]))
    assert out[-1].reason == "abort" and out[-1].text_tail == ""
    assert "".join(e.text for e in out[:-1]) == "wait for it "  # "<EN" could still have become "<END>"


def test_logprob_entries_get_their_token_strings(tokenizer):
    ids = tokenizer(" hello world", add_special_tokens=False)["input_ids"]
    entry = TokenLogprob(ids[0], -0.5, [(ids[0], -0.5), (ids[1], -1.5)])
    prompt_entry = TokenLogprob(ids[1], None, None)
    events = FakeEvents(
        [PromptDone(report(), [prompt_entry]), TokenEvent(ids[0], entry), Finished("length", 1)]
    )
    read(TextStream(events, tokenizer, []))
    assert entry.token == tokenizer.decode([ids[0]]) == " hello"
    assert entry.top == {" hello": -0.5, tokenizer.decode([ids[1]]): -1.5}
    assert prompt_entry.token == tokenizer.decode([ids[1]]) and prompt_entry.top is None
