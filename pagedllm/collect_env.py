"""What this machine gives the engine on CPU, for bug reports (`pagedllm env`, or `python -m
pagedllm.collect_env` as vLLM's collect_env): the CPU and its vector instruction sets, the C compiler,
each native kernel library with the flag set it was built with (building it if the cache lacks it) and
what its code was compiled for, the dtype `dtype=auto` picks, and the way a decode step takes for each
dtype."""

from __future__ import annotations

import os
import platform
import sys

# (shown as, /proc/cpuinfo flag)
CPU_ISA = (
    ("AVX2", "avx2"),
    ("FMA", "fma"),
    ("F16C", "f16c"),
    ("AVX-512F", "avx512f"),
    ("AVX-512 BF16", "avx512_bf16"),
    ("AVX-512 VNNI", "avx512_vnni"),
    ("AMX-TILE", "amx_tile"),
    ("AMX-BF16", "amx_bf16"),
    ("AMX-INT8", "amx_int8"),
)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _decode_paths() -> list[str]:
    """The way a Llama-family model's decode steps take for each dtype (one tensor-parallel rank,
    no LoRA adapter active; `-O0` / `enforce_eager` runs eager where this says compiled)."""
    import torch

    from pagedllm.attention.backends import cpu_decode
    from pagedllm.kernels import build
    from pagedllm.models.native import llama_decode

    attention = cpu_decode.kernel()
    lines = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        path = "native-c" if llama_decode.supports_dtype(dtype) else "compiled"
        native_attention = attention is not None and dtype in (torch.float32, torch.bfloat16)
        prompts = dtype == torch.bfloat16 and attention is not None and bool(attention.prefill_supported())
        notes = "attention: native kernel" if native_attention else "attention: tensor ops"
        if prompts:
            notes += "; prompts: native bfloat16 kernel"
        lines.append(f"  {str(dtype).removeprefix('torch.'):<10} {path:<9} ({notes})")
    quantized = build.load(build.DENSE) is not None and build.load(build.GGUF) is not None
    lines.append(
        "  GGUF quantized (float32/bfloat16 activations): "
        + ("native-c for one-token steps, compiled for several" if quantized else "compiled")
    )
    return lines


def report() -> str:
    import torch

    from pagedllm import __version__, envs
    from pagedllm.config.utils import cache_root
    from pagedllm.kernels import build
    from pagedllm.platforms.cpu import CpuPlatform

    flags = set(CpuPlatform.cpu_flags())
    compiler = build.compiler()
    lines = [
        f"pagedllm {__version__}, torch {torch.__version__}, Python {platform.python_version()}, {platform.platform()}",
        f"CPU: {cpu_model()} ({platform.machine()}), {os.cpu_count()} logical cores",
        "CPU ISA: " + ", ".join(f"{name} {'yes' if flag in flags else 'no'}" for name, flag in CPU_ISA),
        f"C compiler: {compiler or 'none found (set CC)'}",
        f"Kernel cache: {cache_root() / 'kernels'}",
        "Kernel flag set: "
        + (
            f"{envs.PAGEDLLM_KERNEL_ISA} (forced by PAGEDLLM_KERNEL_ISA)"
            if envs.PAGEDLLM_KERNEL_ISA not in (None, "auto")
            else "auto: the best that builds (PAGEDLLM_KERNEL_ISA forces one)"
        ),
        "Kernel libraries (flag set, flags, compiled for):",
    ]
    for library in build.LIBRARIES:
        loaded = build.load(library)
        if loaded is None:
            lines.append(f"  {library.name:<6} not built: {library.otherwise}")
        else:
            lines.append(
                f"  {library.name:<6} {loaded.flag_set.name:<12} {' '.join(loaded.flags)}; "
                f"compiled for {', '.join(loaded.isa()) or 'no vector extensions'}"
            )
    lines.append(f"dtype=auto picks: {str(CpuPlatform().default_dtype(None)).removeprefix('torch.')}")
    lines.append("Decode path by dtype (Llama-family models):")
    lines.extend(_decode_paths())
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
