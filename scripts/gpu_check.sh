#!/usr/bin/env bash
# Every GPU test and benchmark in one call, for the `device` tool's NVIDIA machine (its image has
# python3 with CUDA PyTorch, transformers, Triton, safetensors, tokenizers, jinja2, httpx...).
# pagedllm's other dependencies travel as wheels: run `bash scripts/gpu_wheels.sh` here first, then
#   device.run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in $OUT (the device tool's output folder; /tmp/gpu_check elsewhere).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
status=0
# The tests marked gpu (skipped on CPU machines), then the CUDA half of the model/attention tests.
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
python3 scripts/make_bench_model.py /tmp/smollm2-shaped >/dev/null 2>&1 || status=1
bench() { timeout 150 python3 -m pagedllm.entrypoints.cli bench "$@" --model /tmp/smollm2-shaped; }
bench latency --device cuda --batch-size 1 --input-len 512 --output-len 128 --baseline hf \
    --output-json "$OUT/latency_cuda.json" 2>&1 | tail -n 5 | tee "$OUT/latency_cuda.log" || status=1
bench throughput --device cuda --num-prompts 256 --output-json "$OUT/throughput_cuda.json" 2>&1 \
    | tail -n 5 | tee "$OUT/throughput_cuda.log" || status=1
exit $status
