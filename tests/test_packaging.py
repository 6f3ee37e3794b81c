"""The built wheel ships every C source the package builds at run time (a wheel without one silently
loses its native path)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_ships_every_c_source(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    src = tmp_path / "src"
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".*cache"),
    )
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    (wheel,) = out.glob("pagedllm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {name for name in z.namelist() if name.endswith((".c", ".h"))}
    sources = {
        p.relative_to(REPO).as_posix() for suffix in ("*.c", "*.h") for p in (REPO / "pagedllm").rglob(suffix)
    }
    assert sources, "no C sources found in the source tree"
    assert sources <= shipped, f"missing from the wheel: {sorted(sources - shipped)}"
