"""What third-party clients ask of a server: HEAD probes, models/{id}, the context routes under /v1."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_NAME

pytestmark = pytest.mark.slow

TEXT = (Path(__file__).parent.parent / "data" / "python_history.txt").read_text()


@pytest.mark.parametrize(
    "path", ["/health", "/ready", "/v1/models", f"/v1/models/{MODEL_NAME}", "/version", "/metrics"]
)
def test_every_get_route_answers_head(gateway, path):
    got = httpx.get(gateway.url + path)
    head = httpx.head(gateway.url + path)
    assert got.status_code == head.status_code == 200
    assert head.content == b""


def test_models_retrieve_with_the_official_client(gateway):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    with pytest.raises(NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found"


def test_the_context_routes_are_under_v1_too(gateway):
    v1 = f"{gateway.url}/v1/contexts"
    created = httpx.post(v1, json={"text": "Under v1. " + TEXT[:1500]}, timeout=600).json()
    assert created["object"] == "context" and created["encoded"] is True
    assert created["id"] in [c["id"] for c in httpx.get(v1).json()["data"]]
    assert httpx.get(f"{gateway.url}/contexts/{created['id']}").json()["id"] == created["id"]
    assert (
        httpx.get(f"{v1}/{created['id']}").json()
        == httpx.get(f"{gateway.url}/contexts/{created['id']}").json()
    )
    assert httpx.delete(f"{v1}/{created['id']}").json()["deleted"] is True
    assert httpx.get(f"{v1}/{created['id']}").status_code == 404


def test_health_names_the_device_and_dtype(gateway, bf16_invariant):
    health = httpx.get(f"{gateway.url}/health").json()
    assert health["device"] == "cpu" and health["dtype"] == "float32" and health["model"] == MODEL_NAME
    # CACHEGEN_DTYPE=auto: bf16 weights where they are native and batch-invariant
    assert health["weights_dtype"] == ("bfloat16" if bf16_invariant else None)
    assert health["prompt_attention_dtype"] is None  # bf16 prompt attention only beside non-invariant bf16
    assert health["mlp_activation_dtype"] is None
