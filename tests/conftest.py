"""Fixtures shared by the unit and integration suites."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_process import GatewayProcess

MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The default model's converted safetensors copy (made once, ~20 s the first time)."""
    from engine.loading import convert_default_model, default_cache_dir

    return convert_default_model(default_cache_dir())


@pytest.fixture(scope="session")
def bf16_invariant(model_dir: Path) -> bool:
    """Whether bf16 weights keep the default model batch-invariant on this CPU, which is whether
    ``CACHEGEN_DTYPE=auto`` takes them (AVX512-BF16: yes; AMX: no; ``engine.bf16_weights``)."""
    from engine.loading import load_model

    return load_model(str(model_dir)).bf16_weights


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[GatewayProcess]:
    """One gateway process on the default model and a local store, for the whole session."""
    root = tmp_path_factory.mktemp("gateway")
    with GatewayProcess({"CACHEGEN_STORE": f"file://{root / 'store'}"}, root / "gateway.log") as proc:
        yield proc
