"""House rule: pagedllm/core runs (and is tested) without torch."""

from __future__ import annotations

import subprocess
import sys


def test_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.hashing\n"
        "import pagedllm.core.sched_output, pagedllm.core.runner_output\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
