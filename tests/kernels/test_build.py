"""The kernel loader: each library's sources are its units and every header they include (no `.c`
includes another), all of them and the flags in its build key; every flag set this CPU runs builds
code for its instruction sets; a forced set the CPU cannot run, a missing compiler or an unwritable
cache is a warning and no library, never a crash."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from pagedllm.kernels import build
from pagedllm.platforms.cpu import CpuPlatform

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def test_sources_are_units_and_the_headers_they_include() -> None:
    names = {p.relative_to(build.KERNELS).as_posix() for p in build.sources(build.DENSE)}
    assert names == {
        "cpu/attention_decode.c",
        "cpu/attention_prefill.c",
        "cpu/skinny_gemm.c",
        "cpu/bf16_gemm.c",
        "cpu/llama_decode.c",
        "cpu/build_info.c",
        "cpu/attention.h",
        "cpu/skinny_gemm.h",
        "cpu/bf16_gemm.h",
        "include/vec.h",
        "include/common.h",
    }
    # A header included through another (gguf_blocks.h includes common.h).
    assert {p.name for p in build.sources(build.GGUF)} == {
        "gguf_kernels.c",
        "gguf_panels.c",
        "build_info.c",
        "gguf_blocks.h",
        "common.h",
    }
    # The rule: a .c file includes only headers, so each unit is compiled once per library.
    for unit in build.UNITS.glob("*.c"):
        for name in re.findall(r'#\s*include\s*"([^"]+)"', unit.read_text()):
            assert name.endswith(".h"), f"{unit.name} includes {name}"


def test_the_key_covers_every_header_and_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "kernels"
    shutil.copytree(build.KERNELS, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(build, "KERNELS", copy)
    monkeypatch.setattr(build, "INCLUDE", copy / "include")
    monkeypatch.setattr(build, "UNITS", copy / "cpu")
    before = build.build_key(build.GGUF, build.PORTABLE, True, "cc")
    assert build.build_key(build.GGUF, build.PORTABLE, False, "cc") != before
    assert build.build_key(build.GGUF, build.ISA_SETS[-1], True, "cc") != before
    header = copy / "include" / "common.h"  # reached only through gguf_blocks.h
    header.write_text(header.read_text() + "\n/* changed */\n")
    assert build.build_key(build.GGUF, build.PORTABLE, True, "cc") != before


@needs_compiler
def test_every_flag_set_this_cpu_runs_builds_its_instruction_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = set(CpuPlatform.cpu_flags())
    expected = {
        "avx512-bf16": {"AVX2", "FMA", "F16C", "AVX-512F", "AVX-512 BF16", "AVX-512 VNNI"},
        "avx512": {"AVX2", "FMA", "F16C", "AVX-512F"},
        "avx2": {"AVX2", "FMA", "F16C"},
    }
    ran = []
    for flag_set in build.ISA_SETS:
        if not flag_set.needs <= cpu:
            continue
        monkeypatch.setenv("PAGEDLLM_KERNEL_ISA", flag_set.name)
        loaded = build.load(build.FP8)
        assert loaded is not None and loaded.flag_set is flag_set and loaded.openmp
        assert set(loaded.isa()) == expected[flag_set.name] | {"OpenMP"}
        ran.append(flag_set.name)
    monkeypatch.delenv("PAGEDLLM_KERNEL_ISA")
    native = build.load(build.FP8)
    assert native is not None and native.flag_set is build.NATIVE
    # -march=native reaches at least the best named set this CPU runs.
    assert not ran or set(native.isa()) >= expected[ran[0]]


def test_a_forced_flag_set_the_cpu_cannot_run_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(CpuPlatform, "cpu_flags", staticmethod(lambda: ("sse2", "avx2")))
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        assert build._build(build.FP8, "avx2") is None
        assert build._build(build.FP8, "avx3") is None
    assert "PAGEDLLM_KERNEL_ISA=avx2 needs CPU features this CPU lacks: f16c, fma" in caplog.text
    assert "'avx3' is not one of native, avx512-bf16, avx512, avx2, portable" in caplog.text


def test_unbuildable_library_is_a_warning_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler, or a cache directory that cannot be written: a warning and no library (the callers
    then keep their tensor-op paths)."""
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        assert build._build(build.DENSE, None) is None
    assert "no C compiler could build the CPU kernels" in caplog.text
    monkeypatch.undo()

    def read_only(path: Path) -> Path:
        raise PermissionError(f"[Errno 13] Permission denied: '{path}'")

    monkeypatch.setattr(build.cache, "private_directory", read_only)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedllm.kernels"):
        assert build._build(build.DENSE, None) is None
    assert "Permission denied" in caplog.text and "tensor ops" in caplog.text
