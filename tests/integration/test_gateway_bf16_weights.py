"""A gateway with bf16 weights (``CACHEGEN_DTYPE=bf16-weights``) beside a float32 one, over one store.

The precision is part of every key: the bf16-weights gateway never reuses KV
the float32 one stored (its numbers differ), and the other way round; each
reuses its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.bf16_weights import native_bf16
from tests.conftest import MODEL_NAME
from tests.gateway_process import GatewayProcess

pytestmark = pytest.mark.slow

TEXT = "Precision test.\n" + (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()[:2600]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    root = tmp_path_factory.mktemp("bf16")
    store = {"CACHEGEN_STORE": f"file://{root / 'store'}", "CACHEGEN_PREFIX_CACHE": "false"}
    fp32 = GatewayProcess({**store, "CACHEGEN_DTYPE": "float32"}, root / "fp32.log")
    bf16 = GatewayProcess({**store, "CACHEGEN_DTYPE": "bf16-weights"}, root / "bf16.log")
    with fp32, bf16:
        yield fp32, bf16


def ask(gateway: GatewayProcess, question: str) -> dict:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "system", "content": TEXT}, {"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_health_says_the_weights_are_bf16(pair, bf16_invariant):
    fp32, bf16 = pair
    assert httpx.get(f"{bf16.url}/health").json()["weights_dtype"] == "bfloat16"
    assert httpx.get(f"{fp32.url}/health").json()["weights_dtype"] is None
    assert httpx.get(f"{bf16.url}/health").json()["dtype"] == "float32"  # activations and KV
    # prompts attend in bf16 where bf16 products are not batch-invariant anyway (AMX)
    prompts = "bfloat16" if native_bf16() and not bf16_invariant else None
    assert httpx.get(f"{bf16.url}/health").json()["prompt_attention_dtype"] == prompts
    assert httpx.get(f"{fp32.url}/health").json()["prompt_attention_dtype"] is None
    assert httpx.get(f"{bf16.url}/health").json()["mlp_activation_dtype"] == prompts  # the same CPUs
    assert httpx.get(f"{fp32.url}/health").json()["mlp_activation_dtype"] is None


def test_each_precision_reuses_only_its_own_kv(pair):
    fp32, bf16 = pair
    context = {"messages": [{"role": "system", "content": TEXT}]}
    stored = httpx.post(f"{fp32.url}/contexts", json=context, timeout=300).json()
    assert stored["cached_tokens"] > 0

    # the same content on the bf16-weights gateway: another id, encoded anew, not listed before
    assert stored["id"] not in [c["id"] for c in httpx.get(f"{bf16.url}/contexts").json()["data"]]
    first = ask(bf16, "Who created Python?")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["message"]["content"]
    own = httpx.post(f"{bf16.url}/contexts", json=context, timeout=300).json()
    assert own["id"] != stored["id"] and own["cached_tokens"] > 0

    # now each reuses what it stored itself
    assert ask(bf16, "When was it released?")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert ask(fp32, "When was it released?")["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
