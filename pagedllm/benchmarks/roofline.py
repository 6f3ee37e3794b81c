"""Machine limits measured in the same run as a benchmark: memory copy bandwidth and matmul rate.

The decode roofline is (bytes of weights read per step) / bandwidth; the compute roofline is
2 * params FLOPs per token / matmul rate. Both probes keep their best time: on a shared machine a slow
phase only ever makes a probe read low, and a low limit would overstate the benchmark's fraction of it.
Benchmarks probe before and after their run and keep the better reading (`Roofline.best`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def _best_seconds(fn, repeats: int, min_seconds: float = 0.0) -> float:
    """Fastest of at least `repeats` timed calls, repeated until `min_seconds` have passed."""
    fn()  # warm-up: page faults, kernel selection
    best, spent, calls = float("inf"), 0.0, 0
    while calls < repeats or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def copy_bandwidth(num_bytes: int = 1 << 28, repeats: int = 5, min_seconds: float = 0.3) -> float:
    """Bytes per second moved by a large tensor copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_seconds(lambda: dst.copy_(src), repeats, min_seconds)


def matmul_flops(
    m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5, min_seconds: float = 0.3
) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul in `dtype`."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    return 2 * m * k * n / _best_seconds(lambda: torch.mm(a, b), repeats, min_seconds)


@dataclass
class Roofline:
    bandwidth: float  # bytes/s
    matmul_rate: float  # FLOP/s in the benchmark's dtype

    @classmethod
    def measure(cls, dtype: torch.dtype, hidden: int, intermediate: int, rows: int = 2048) -> Roofline:
        # The model's own MLP products at a prompt step's row count rather than a square matmul: the
        # best rate its layers can reach (a 256-row probe read below what the engine's prompt steps
        # reached, which made the "limit" no limit).
        rate = max(
            matmul_flops(rows, hidden, intermediate, dtype), matmul_flops(rows, intermediate, hidden, dtype)
        )
        return cls(copy_bandwidth(), rate)

    def best(self, other: Roofline) -> Roofline:
        """The higher of two readings of each limit (probes before and after a run)."""
        return Roofline(max(self.bandwidth, other.bandwidth), max(self.matmul_rate, other.matmul_rate))

    def compute_tokens_per_s(self, num_params: int) -> float:
        return self.matmul_rate / (2 * num_params)

    def describe(self) -> str:
        return f"copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, matmul {self.matmul_rate / 1e12:.2f} TFLOP/s"
