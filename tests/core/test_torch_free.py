"""House rule: pagedllm/core imports no torch (the scheduler runs in the engine-core process and in
tests with no model)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import pagedllm.core.block_pool, pagedllm.core.hashing, pagedllm.core.kv_cache_manager
import pagedllm.core.request, pagedllm.core.scheduler, pagedllm.core.sched_output, pagedllm.core.runner_output
heavy = sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)
assert not heavy, heavy
"""


def test_core_imports_no_torch() -> None:
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
