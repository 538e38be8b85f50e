"""Every codec level, end to end: pre-encoded through the API, then answering through it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from codec import DEFAULT_LEVELS
from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

LEVELS = [level.name for level in DEFAULT_LEVELS]


@pytest.fixture(scope="module")
def ids(tokenizer) -> list[int]:
    text = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()
    return tokenizer(text)["input_ids"][40:560]


def complete(url: str, ids: list[int], **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_level_is_stored_and_served(gateway, ids):
    created = httpx.post(f"{gateway.url}/contexts", json={"prompt_token_ids": ids}, timeout=600).json()
    assert set(created["bytes"]) == set(LEVELS)
    lossless = created["bytes"]["lossless"]
    assert all(created["bytes"][name] < lossless / 4 for name in LEVELS if name != "lossless")
    for name in LEVELS:
        out = complete(gateway.url, ids, kv_quality=name)
        info = out["kv_cache_info"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 512, name
        assert {c["level"] for c in info["chunks"]} == {name}
        assert sum(c["bytes"] for c in info["chunks"]) == created["bytes"][name]
        assert out["choices"][0]["text"]
    # auto takes the best level stored
    assert {c["level"] for c in complete(gateway.url, ids)["kv_cache_info"]["chunks"]} == {LEVELS[0]}


def test_auto_falls_back_to_the_levels_that_exist(gateway, ids):
    other = ids[:300][::-1] + ids[300:]
    name = LEVELS[-1]
    created = httpx.post(
        f"{gateway.url}/contexts", json={"prompt_token_ids": other, "levels": [name]}, timeout=600
    ).json()
    assert list(created["bytes"]) == [name]
    out = complete(gateway.url, other)
    assert {c["level"] for c in out["kv_cache_info"]["chunks"]} == {name}
    # asking for a level that is not stored recomputes
    assert complete(gateway.url, other, kv_quality="lossless")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
