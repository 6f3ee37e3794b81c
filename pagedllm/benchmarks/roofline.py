"""Machine limits measured in the same run as a benchmark: memory copy bandwidth and matmul rate.

The decode roofline is (bytes of weights read per step) / bandwidth; the compute roofline is
2 * params FLOPs per token / matmul rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(num_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / _best_seconds(lambda: dst.copy_(src), repeats)


def matmul_flops(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul in `dtype`."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    return 2 * m * k * n / _best_seconds(lambda: torch.mm(a, b), repeats)


@dataclass
class Roofline:
    bandwidth: float  # bytes/s
    matmul_rate: float  # FLOP/s in the benchmark's dtype

    @classmethod
    def measure(cls, dtype: torch.dtype, hidden: int, intermediate: int) -> Roofline:
        # A batch-shaped matmul (256 rows through an MLP weight) rather than a square one: closer to
        # what a decode/prefill step actually runs.
        return cls(copy_bandwidth(), matmul_flops(256, hidden, intermediate, dtype))

    def decode_tokens_per_s(self, weight_bytes: int) -> float:
        """Single-stream decode limit: every step reads every weight once."""
        return self.bandwidth / weight_bytes

    def compute_tokens_per_s(self, num_params: int) -> float:
        return self.matmul_rate / (2 * num_params)

    def describe(self) -> str:
        return f"copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, matmul {self.matmul_rate / 1e12:.2f} TFLOP/s"
