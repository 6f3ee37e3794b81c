"""What a peer run records about the machine: CPU model, the ISA flags that pick kernels, cores, memory,
load average, and the copy bandwidth (the decode roofline's limit, probed before and after, best kept)."""

from __future__ import annotations

import os
import platform
from typing import Any

# The flags that decide which kernels the engines take.
ISA_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", "x86_64", ""):
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def describe() -> dict[str, Any]:
    model, flags = _cpuinfo()
    with open("/proc/meminfo") as f:
        mem_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal"))
    return {
        "cpu": model,
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_start": load_average(),
    }


def default_dtype() -> str:
    """The dtype every engine runs in unless told otherwise: what pagedllm's `dtype=auto` picks on this
    CPU (bf16 with native bf16 dot products, else float32), so all engines run the same one."""
    from pagedllm.platforms.cpu import CpuPlatform

    return "bfloat16" if CpuPlatform.has_native_bf16() else "float32"


def copy_bandwidth(threads: int) -> float:
    """Bytes/s of a large tensor copy, read and write counted (pagedllm's roofline probe), on the
    engines' thread count (one core's share of the bandwidth is less than the machine's)."""
    import torch

    from pagedllm.benchmarks.roofline import copy_bandwidth as probe

    torch.set_num_threads(threads)
    return probe()
