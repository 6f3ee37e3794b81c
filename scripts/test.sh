#!/usr/bin/env bash
# Installs pagedllm with its test extras, checks style and import contracts, and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "[test]"
python3 -m ruff check pagedllm tests
# The layers and their independence (pyproject's [tool.importlinter]): an upward import fails here,
# naming the contract it breaks.
lint-imports --no-cache
python3 -m pytest -q -p no:cacheprovider --durations=30 "$@"
bash scripts/wheel_smoke.sh
