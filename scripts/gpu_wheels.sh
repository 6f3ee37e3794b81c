#!/usr/bin/env bash
# Fetches, into .whl/ (git-ignored), the wheels of pagedllm's dependencies that the `device` tool's
# GPU image lacks (Python 3.12, x86_64), for scripts/gpu_check.sh to install there. The embedded model
# package (92 MB) is over the tool's 64 MiB transfer limit: the check benchmarks a SmolLM2-shaped
# random model instead (scripts/make_bench_model.py).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 any; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    gguf msgspec pyzmq fastapi starlette uvicorn pydantic pydantic-core annotated-types \
    typing-inspection openai distro jiter sniffio
du -sh .whl
