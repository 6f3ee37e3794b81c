"""House rules: pagedllm/core runs (and is tested) without torch, and never imports the layers above it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pagedllm.core

CORE_DIR = Path(pagedllm.core.__file__).parent


def test_core_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import pagedllm.core.scheduler, pagedllm.core.kv_cache_manager, pagedllm.core.hashing\n"
        "import pagedllm.core.sched_output, pagedllm.core.runner_output, pagedllm.core.outputs\n"
        "print('torch' in sys.modules, any(m.startswith('pagedllm.engine') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"


def _imported_modules(path: Path) -> list[str]:
    """Every module a file imports, including imports under `if TYPE_CHECKING:` and inside functions."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
    return names


def test_core_never_imports_engine() -> None:
    files = sorted(CORE_DIR.glob("*.py"))
    assert len(files) > 5
    upward = {
        f"{path.name}: {name}"
        for path in files
        for name in _imported_modules(path)
        if name == "pagedllm.engine" or name.startswith("pagedllm.engine.")
    }
    assert not upward, f"core/ imports engine/: {sorted(upward)}"
