"""Every codec level, end to end: pre-encoded through the API, then answering through it.

Twice: on the gateway's built-in table, and on the other of the two shipped tables. The built-in
table is the transform levels of format 5 (``codec/levels/SmolLM2-135M-Instruct.json``) on a CPU
with native bf16 (``app.gateway.builtin_table``), and format 4's levels
(``SmolLM2-135M-Instruct.v4.json``) on one without: either way both tables are served here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from codec import DEFAULT_LEVELS
from codec.transform import cheap_inverse
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

LEVELS = [level.name for level in DEFAULT_LEVELS]


TABLES = Path(__file__).resolve().parents[2] / "codec" / "levels"
# the shipped table that the built-in one is not, on this machine's CPU
OTHER_TABLE = TABLES / (
    "SmolLM2-135M-Instruct.v4.json" if cheap_inverse("cpu") else "SmolLM2-135M-Instruct.json"
)


@pytest.fixture(scope="module", params=["builtin", "other"])
def gateway(request, tmp_path_factory) -> Iterator[GatewayProcess]:
    """Without the prefix cache: every request here must load the store's levels, not KV that an
    earlier request left in memory. With an LRU tier (none by default in front of a local store):
    the chunks the pre-encodes write stay in it, so no read measures the link, and auto never
    weighs a level against recomputing from text (exact, and within a loose budget on a measured
    link): what is tested here is which levels auto may use."""
    root = tmp_path_factory.mktemp("levels")
    env = {
        "CACHEGEN_STORE": f"file://{root / 'store'}",
        "CACHEGEN_PREFIX_CACHE": "false",
        "CACHEGEN_STORE_CACHE_BYTES": str(512 * 2**20),
    }
    if request.param == "other":
        env["CACHEGEN_LEVELS_FILE"] = str(OTHER_TABLE)
    with GatewayProcess(env, root / "gateway.log") as proc:
        yield proc


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
    question = ids + ids[:3]  # continues past the context, so its 8-token tail is reused too
    for name in LEVELS:
        out = complete(gateway.url, question, kv_quality=name)
        info = out["kv_cache_info"]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 520, name
        assert {c["level"] for c in info["chunks"]} == {name}
        assert sum(c["bytes"] for c in info["chunks"]) == created["bytes"][name]
        assert out["choices"][0]["text"]
    # auto without a budget: the fastest plan at or above the default floor (medium); which one
    # depends on measured costs (lossless, when it is memory-hot and decode is not disturbed)
    auto = complete(gateway.url, ids)["kv_cache_info"]
    assert auto["cached_tokens"] == 512
    assert {c["level"] for c in auto["chunks"]} <= {"lossless", "high", "medium"}
    # each load reserved its fetched chunks' memory with its KV (no prefix cache here): all of it is
    # given back once the requests are done
    assert kv_memory_used(gateway.url) == 0


def kv_memory_used(url: str) -> float:
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith("cachegen:kv_memory_used_bytes "))
    return float(line.split()[-1])


def test_auto_respects_the_quality_floor_unless_given_a_budget(gateway, ids):
    other = ids[:300][::-1] + ids[300:]
    name = LEVELS[-1]  # below the default floor
    created = httpx.post(
        f"{gateway.url}/contexts", json={"prompt_token_ids": other, "levels": [name]}, timeout=600
    ).json()
    assert list(created["bytes"]) == [name]
    assert complete(gateway.url, other)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # a budget lets auto use any level (here the only one there is, or text when that is faster)
    out = complete(gateway.url, other, kv_slo_ms=60_000)
    sources = {c["level"] or c["source"] for c in out["kv_cache_info"]["chunks"]}
    assert sources <= {name, "text"} and name in sources
    assert out["kv_cache_info"]["budget_ms"] == 60_000 and out["kv_cache_info"]["slo_met"] is True
    # a named level is used as is; one that is not stored recomputes
    named = complete(gateway.url, other, kv_quality=name)["kv_cache_info"]
    assert named["cached_tokens"] == 512 and {c["level"] for c in named["chunks"]} == {name}
    assert (
        complete(gateway.url, other, kv_quality="lossless")["usage"]["prompt_tokens_details"]["cached_tokens"]
        == 0
    )
