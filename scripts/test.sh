#!/usr/bin/env bash
# The project's test command: install (with the test tools and Triton), then the whole suite
# (unit + integration).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
