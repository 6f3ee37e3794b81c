"""The import contracts of pyproject (checked by `lint-imports` in scripts/test.sh) cover the whole
package, and an upward import breaks them with the contract's name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

import pagedllm

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(pagedllm.__file__).parent
LAYERS = "pagedllm layers (each imports only the layers below it)"


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_every_top_level_module_has_a_layer() -> None:
    # A module left out of the layers contract could import anything: a new package needs its place.
    (layers,) = [c for c in _contracts() if c["name"] == LAYERS]
    listed = {name.strip() for layer in layers["layers"] for name in re.split(r"[|:]", layer)}
    modules = {
        f"pagedllm.{path.stem}"
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    assert len(modules) > 30
    assert modules - listed == set()
    assert listed - modules == set()


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(["lint-imports", "--no-cache"], cwd=root, env=env, capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter (the test extra) is not installed")
def test_an_upward_import_breaks_the_layers(tmp_path: Path) -> None:
    shutil.copytree(PACKAGE, tmp_path / "pagedllm", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    # core/ (the bottom of the engine) may import what lies below it ...
    (tmp_path / "pagedllm/core/added.py").write_text("import pagedllm.errors  # noqa: F401\n")
    run = _lint_imports(tmp_path)
    assert run.returncode == 0, run.stdout
    # ... but not the engine above it.
    (tmp_path / "pagedllm/core/added.py").write_text("import pagedllm.engine.protocol  # noqa: F401\n")
    run = _lint_imports(tmp_path)
    assert run.returncode != 0
    assert f"{LAYERS} BROKEN" in run.stdout
    assert "pagedllm.core.added -> pagedllm.engine.protocol" in run.stdout
