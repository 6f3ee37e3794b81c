"""Products of a few rows (2 to 8: a small decode batch, or one request verifying its drafted tokens)
with a dense float32 / bfloat16 weight, streaming the weight once (kernels/cpu/skinny_gemm.c, in the
dense kernel library).

A step of a few tokens is bound by reading the weights, as a one-token step is; torch's CPU GEMM
instead packs the weight or runs a matrix-vector product per row for such shapes, so verifying k
drafted tokens cost several one-token steps (figures: benchmarks/RESULTS.md, "Figures behind code
choices"), which ate the gain of speculative decoding. `linear` sends these
shapes here (`torch.ops.pagedllm.skinny_linear`, opaque to torch.compile like the attention op).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from pagedllm.kernels import build

_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# skinny_gemm.h's MAX_ROWS: every input row keeps one accumulator in a register during the one pass
# over a weight row; 8 of them and the weight chunk fit AVX2's 16 registers.
MAX_ROWS = 8
# Fewer rows go to torch: one row is its matrix-vector product (or Inductor's multiply-reduce), which
# already streams the weight once.
MIN_ROWS = 2


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build.cdll(build.DENSE)
    if lib is None:
        return None
    for suffix in _SUFFIXES.values():
        fn = getattr(lib, f"skinny_gemm_{suffix}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, *[ctypes.c_void_p] * 3, *[ctypes.c_int64] * 3]
        fn.restype = ctypes.c_int
    lib.skinny_gemm_max_rows.restype = ctypes.c_int
    if lib.skinny_gemm_max_rows() != MAX_ROWS:
        raise RuntimeError(f"skinny_gemm.h takes {lib.skinny_gemm_max_rows()} rows, not MAX_ROWS={MAX_ROWS}")
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernel library is built here (a constant to torch.compile, which must not trace
    the build)."""
    return _library() is not None


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `skinny_linear` computes `F.linear(x, weight, bias)` for these tensors. In a graph
    traced with a dynamic row count, only where its range proves the bounds (the compiled forward
    gives 2..MAX_ROWS tokens their own range): a guard would specialize the graph to one side. Not
    under a torch function mode (eager), which may be there to intercept `F.linear`."""
    if x.dim() != 2:
        return False
    if not torch.compiler.is_compiling() and torch._C._is_torch_function_mode_enabled():
        # A mode that intercepts `F.linear` (the batch-invariant mode pads every product) must see it.
        return False
    rows = x.shape[0]
    return (
        statically_known_true(rows >= MIN_ROWS)
        and statically_known_true(rows <= MAX_ROWS)
        and x.device.type == "cpu"
        and x.dtype in _SUFFIXES
        and weight.dtype == x.dtype
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and available()
    )


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a tensor pair `serves` accepts."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    y = torch.empty(m, n, dtype=x.dtype)
    status = getattr(_library(), f"skinny_gemm_{_SUFFIXES[x.dtype]}")(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        n,
        k,
    )
    if status != 0:
        raise RuntimeError(f"few-row product rejected {m} rows (status {status})")
    return y


def _skinny_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIBRARY.impl("skinny_linear", skinny_linear, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::skinny_linear", _skinny_linear_fake, lib=_LIBRARY)
