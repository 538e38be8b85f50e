"""Incremental detokenization with stop strings, on the default model's real tokenizer."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.detokenize import IncrementalText

TEXTS = [
    "Hello, world! How are you?",
    "naïve café — 東京 🙂 done",
    "   leading spaces\nand\ttabs",
    "trailing spaces and newlines  \n\n",
    "東京都の天気は晴れです。明日も晴れるでしょう。",
    "한국어 텍스트와 العربية والعبرية עברית",
    "family 👩‍👩‍👧‍👦, flag 🇯🇵, skin 👍🏽, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "e\u0301 combining accents a\u0308 and a literal \ufffd replacement char",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))\r\n",
    "🙂🙂🙂",
    "x",
]


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    to_char = bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([to_char[b] for b in text.encode()])


def natural_tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_special_tokens(tokenizer, ids: list[int], seed: int) -> list[int]:
    rng = random.Random(seed)
    out = list(ids)
    for _ in range(max(1, len(ids) // 4)):
        out.insert(rng.randrange(len(out) + 1), rng.choice(tokenizer.all_special_ids))
    return out


def expected(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """The whole output decoded at once, cut before the stop string that is complete first."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    found = [(at + len(stop), at) for stop in stops if (at := text.find(stop)) != -1]
    return (text[: min(found)[1]], True) if found else (text, False)


def stream_ids(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, bool]:
    inc = IncrementalText(tokenizer, stops)
    out = []
    for i, token in enumerate(ids):
        out.append(inc.push(token))
        if inc.stopped:
            break
        # never ahead of the whole decode so far, and what may still become a stop is not out yet
        emitted, so_far = "".join(out), tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        assert so_far.startswith(emitted)
        unsent = len(so_far) - len(emitted)
        assert not any(so_far.endswith(stop[:n]) for stop in stops for n in range(unsent + 1, len(stop)))
    out.append(inc.finish())
    assert inc.finish() == ""
    return "".join(out), inc.stopped


def stream(tokenizer, text: str, stops: list[str]) -> tuple[str, bool]:
    return stream_ids(tokenizer, natural_tokens(tokenizer, text), stops)


@pytest.mark.parametrize(
    "text",
    ["Hello, world! How are you?", "naïve café — 東京 🙂 done", "   leading spaces\nand\ttabs"],
)
def test_deltas_add_up_to_the_text(tokenizer, text):
    assert stream(tokenizer, text, []) == (text, False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["natural", "bytes"])
@pytest.mark.parametrize("specials", [False, True])
def test_deltas_add_up_to_the_full_decode(tokenizer, text, split, specials):
    ids = natural_tokens(tokenizer, text) if split == "natural" else byte_tokens(tokenizer, text)
    if specials:
        ids = with_special_tokens(tokenizer, ids, seed=len(text))
    assert stream_ids(tokenizer, ids, []) == expected(tokenizer, ids, []) == (text, False)


def test_only_incomplete_characters_wait_for_the_next_token(tokenizer):
    text = "a東京🙂b 👩‍👩‍👧 é"
    ids = byte_tokens(tokenizer, text)
    inc = IncrementalText(tokenizer, [])
    emitted = ""
    for i, token in enumerate(ids):
        emitted += inc.push(token)
        assert emitted == tokenizer.decode(ids[: i + 1]).rstrip("\ufffd")
    assert emitted + inc.finish() == text


def test_special_tokens_alone_give_no_text(tokenizer):
    specials = [t for t, added in tokenizer.added_tokens_decoder.items() if added.special]
    assert stream_ids(tokenizer, specials, ["<|"]) == ("", False)


def test_invalid_bytes_come_out_as_the_full_decode_does(tokenizer):
    to_char = bytes_to_unicode()
    # stray continuation bytes, then a lead byte with no continuation, then text
    raw = bytes([0x80] * 12 + [0xE6]) + b" ok"
    ids = tokenizer.convert_tokens_to_ids([to_char[b] for b in raw])
    assert stream_ids(tokenizer, ids, []) == expected(tokenizer, ids, [])
    # and an incomplete character at the very end is released by finish()
    assert stream_ids(tokenizer, ids[:-3], []) == expected(tokenizer, ids[:-3], [])


def test_stop_string_is_cut_and_never_emitted(tokenizer):
    text, stopped = stream(tokenizer, "one two three four five", ["three"])
    assert stopped and text == "one two "


def test_stop_string_spanning_tokens(tokenizer):
    text, stopped = stream(tokenizer, "alpha beta<END>gamma", ["<END>"])
    assert stopped and text == "alpha beta"


def test_partial_stop_is_released_at_the_end(tokenizer):
    text, stopped = stream(tokenizer, "wait for it <EN", ["<END>"])
    assert not stopped and text == "wait for it <EN"


@pytest.mark.parametrize(
    ("text", "stops", "want"),
    [
        ("baa", ["a", "baa"], "b"),  # "a" is complete before "baa" is, so a stream stops there
        ("STOP right at the start", ["STOP"], ""),
        (" leading space stop", [" lead"], ""),
        ("one two three four five", ["five", "two"], "one "),  # the first in the text wins, not in the list
        ("a <E b <EN c <END> d", ["<END>"], "a <E b <EN c "),  # partial stops held, then released
        ("aaab", ["aab"], "a"),  # a stop that overlaps its own start
        ("東京都の天気", ["京都"], "東"),  # a multi-byte stop
        ("smile 🙂 please", ["🙂"], "smile "),
        ("line one\n\nline two", ["\n\n"], "line one"),
        ("no stop here", ["zzz", "STOP"], "no stop here"),
        ("the whole text", ["the whole text"], ""),
    ],
)
@pytest.mark.parametrize("split", ["natural", "bytes"])
def test_stop_strings(tokenizer, text, stops, want, split):
    ids = natural_tokens(tokenizer, text) if split == "natural" else byte_tokens(tokenizer, text)
    got = stream_ids(tokenizer, ids, stops)
    assert got == expected(tokenizer, ids, stops) == (want, want != text)


def test_nothing_is_emitted_after_a_stop(tokenizer):
    inc = IncrementalText(tokenizer, ["END"])
    out = "".join(inc.push(t) for t in natural_tokens(tokenizer, "before END after"))
    assert inc.stopped and out + inc.finish() == "before "
    assert inc.push(natural_tokens(tokenizer, " more")[0]) == "" and inc.finish() == ""


ALPHABET = st.sampled_from(list("ab <>\n\t.,") + ["東", "京", "🙂", "👩‍👧", "é", "ß", "  ", "END", "ing"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(ALPHABET, max_size=40).map("".join),
    st.lists(st.lists(ALPHABET, min_size=1, max_size=3).map("".join), max_size=3),
    st.sampled_from(["natural", "bytes"]),
)
def test_random_text_matches_the_full_decode(tokenizer, text, stops, split):
    ids = natural_tokens(tokenizer, text) if split == "natural" else byte_tokens(tokenizer, text)
    assert stream_ids(tokenizer, ids, stops) == expected(tokenizer, ids, stops)


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def test_each_token_decodes_a_bounded_window(tokenizer):
    base = natural_tokens(tokenizer, " ".join(TEXTS))
    ids = (base * (2000 // len(base) + 1))[:2000]
    counting = CountingTokenizer(tokenizer)
    inc = IncrementalText(counting, ["never appears"])
    out = []
    for n, token in enumerate(ids, 1):
        out.append(inc.push(token))
        assert len(counting.calls) <= 2 * n
    out.append(inc.finish())
    assert "".join(out) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(counting.calls) <= 16
    assert sum(counting.calls) <= 16 * len(ids)
    assert len(inc._held) < len("never appears")
