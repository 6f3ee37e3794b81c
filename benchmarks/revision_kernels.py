"""Kernel units of another git revision, built with this tree's builder flags for this CPU, for the
benchmarks' `--baseline REV` (old and new kernels timed side by side in one process)."""

from __future__ import annotations

import ctypes
import subprocess
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from pagedllm.kernels import build


def build_units(rev: str, units: tuple[str, ...]) -> ctypes.CDLL:
    """`rev`'s `pagedllm/kernels/cpu/<unit>` files (with that revision's headers) in one library."""
    archive = subprocess.run(
        ["git", "archive", rev, "pagedllm/kernels"], capture_output=True, check=True, cwd=build.KERNELS.parents[1]
    ).stdout
    folder = Path(tempfile.mkdtemp(prefix=f"kernels-{rev}-"))
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    kernels = folder / "pagedllm" / "kernels"
    compiler = build.compiler()
    assert compiler is not None, "no C compiler"
    out = folder / "baseline.so"
    command = [compiler, *build._flags(build.NATIVE, True), "-fPIC", "-shared", "-I", str(kernels / "include")]
    command += ["-I", str(kernels / "cpu"), "-o", str(out), *(str(kernels / "cpu" / u) for u in units)]
    subprocess.run(command, check=True)
    return ctypes.CDLL(str(out))
