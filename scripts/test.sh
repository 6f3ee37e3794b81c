#!/usr/bin/env bash
# Installs pagedllm with its test extras and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh "[test]"
python3 -m ruff check pagedllm tests
python3 -m pytest -q -p no:cacheprovider --durations=30 "$@"
bash scripts/wheel_smoke.sh
