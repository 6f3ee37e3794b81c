"""The kernel libraries built with a forced flag set (`PAGEDLLM_KERNEL_ISA`): the AVX2 and portable code
compiled and run on a machine that has more (an AVX-512 machine's own builds take its AVX-512 paths)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from pagedllm.attention.backends import cpu_decode
from pagedllm.kernels import build
from pagedllm.layers import skinny_gemm
from pagedllm.layers.quant import fp8, gguf_native, int4_native
from pagedllm.models.native import llama_decode
from pagedllm.platforms.cpu import CpuPlatform

# The flag sets below -march=native that every x86-64 test machine runs (portable: any CPU).
FORCED_SETS = ("avx2", "portable")
# What each forced set's code is compiled for (cpu/build_info.c); avx512-bf16 is forced only by the tests of
# the kernels that have a path for it.
EXPECTED_ISA = {
    "avx512-bf16": ("AVX2", "FMA", "F16C", "AVX-512F", "AVX-512 BF16", "AVX-512 VNNI"),
    "avx2": ("AVX2", "FMA", "F16C"),
    "portable": (),
}
_BINDINGS = (
    cpu_decode.kernel,
    skinny_gemm._library,
    llama_decode._library,
    gguf_native.library,
    int4_native.library,
    fp8.library,
)


def _clear() -> None:
    for cached in _BINDINGS:
        cached.cache_clear()


@contextlib.contextmanager
def forced_flag_set(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """Every kernel binding loads its library built with flag set `name` inside the block (skipped
    where this CPU cannot run that code), and the machine's own builds again after it."""
    missing = build.FLAG_SETS[name].needs - set(CpuPlatform.cpu_flags())
    if missing:
        pytest.skip(f"this CPU cannot run the {name} kernels (no {', '.join(sorted(missing))})")
    with monkeypatch.context() as mp:
        mp.setenv("PAGEDLLM_KERNEL_ISA", name)
        _clear()
        try:
            loaded = build.load(build.DENSE)
            assert loaded is not None and loaded.flag_set.name == name
            compiled = set(loaded.isa()) - {"OpenMP"}
            assert compiled == set(EXPECTED_ISA[name]), compiled
            yield
        finally:
            _clear()
