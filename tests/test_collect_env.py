"""`pagedllm.collect_env`: the CPU and its instruction sets as /proc/cpuinfo lists them, each kernel
library's flag set and what it compiled for, and the decode path each dtype takes, for this machine's
own builds and for a forced AVX2 build (whose float32 products run natively and whose bfloat16 ones,
lacking AVX512-BF16, run the compiled graphs)."""

from __future__ import annotations

import re

import pytest
from kernel_builds import forced_flag_set

from pagedllm import collect_env
from pagedllm.kernels import build
from pagedllm.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _line(report: str, start: str) -> str:
    (line,) = [line for line in report.splitlines() if line.lstrip().startswith(start)]
    return line


def test_report_names_the_cpu_its_isa_builds_and_decode_paths() -> None:
    report = collect_env.report()
    flags = set(CpuPlatform.cpu_flags())
    assert _line(report, "CPU:").startswith(f"CPU: {collect_env.cpu_model()} ")
    isa = _line(report, "CPU ISA:")
    for name, flag in collect_env.CPU_ISA:
        assert f"{name} {'yes' if flag in flags else 'no'}" in isa
    for library in build.LIBRARIES:
        assert re.match(
            rf"  {library.name} +native +-O3 .*-march=native -fopenmp; compiled for ",
            _line(report, library.name + " "),
        )
    bf16 = "native-c" if "avx512_bf16" in flags else "compiled"
    assert _line(report, "bfloat16").split()[:2] == ["bfloat16", bf16]
    assert _line(report, "float16").split()[:2] == ["float16", "compiled"]
    auto = "bfloat16" if CpuPlatform.has_native_bf16() else "float32"
    assert _line(report, "dtype=auto picks:") == f"dtype=auto picks: {auto}"


def test_report_follows_a_forced_flag_set(monkeypatch: pytest.MonkeyPatch) -> None:
    with forced_flag_set(monkeypatch, "avx2"):
        report = collect_env.report()
    assert "forced by PAGEDLLM_KERNEL_ISA" in _line(report, "Kernel flag set:")
    dense = _line(report, "dense ")
    assert re.match(
        r"  dense +avx2 +.*-mavx2 -mfma -mf16c -fopenmp; compiled for AVX2, FMA, F16C, OpenMP$", dense
    )
    assert _line(report, "float32").split()[:2] == ["float32", "native-c"]
    assert _line(report, "bfloat16").split()[:2] == ["bfloat16", "compiled"]


def test_main_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert collect_env.main() == 0
    assert "Decode path by dtype" in capsys.readouterr().out
