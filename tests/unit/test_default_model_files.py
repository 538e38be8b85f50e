"""The converted default model is a plain HF directory: what vLLM, llama.cpp's converter and others read."""

from __future__ import annotations

import json

from safetensors import safe_open


def test_tied_weights_are_stored_under_the_embeddings_name(model_dir):
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    config = json.loads((model_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len([n for n in names if n.startswith("model.layers.")]) == 9 * config["num_hidden_layers"]
    assert "quantization_config" not in config
