"""Batch-invariant bfloat16 products (kernels/cpu/bf16_gemm.c, in the dense kernel library): `x W^T (+ bias)` where each output element is
computed by the same operations whatever the number of rows, the row's place among them and the
number of threads.

torch's CPU GEMM (oneDNN) picks kernels and blockings by shape, and the native decode path and the
compiled graphs each had their own products for one row and for a few: a token computed in a prompt,
as a decode row alone, beside other requests or verifying drafts came out different in the last bits,
enough to flip a seeded draw or a greedy near-tie after a few tokens. The native model body
(`pagedllm.models.native.llama_decode`) runs every product of a bfloat16 model through this kernel,
and `LogitsProcessor` computes bfloat16 logits with it, in float32 (`float_out`: no rounding of the
logits to bfloat16, where near-ties would become ties).

`torch.ops.pagedllm.bf16_linear` is opaque to torch.compile (a graph may call it, as the one-row LM
head's does).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from pagedllm.kernels import build


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = build.cdll(build.DENSE)
    if lib is None:
        return None
    lib.bf16_gemm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        *[ctypes.c_void_p] * 3,
        *[ctypes.c_int64] * 3,
        ctypes.c_int,
    ]
    lib.bf16_gemm.restype = ctypes.c_int
    lib.bf16_gemm_supported.restype = ctypes.c_int
    return lib


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernel runs here: a C compiler and a CPU with AVX512-BF16 (a constant to
    torch.compile, which must not trace the build)."""
    lib = _library()
    return lib is not None and bool(lib.bf16_gemm_supported())


def serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `bf16_linear` computes `F.linear(x, weight, bias)` for these tensors: bfloat16 on the
    CPU, 2-D rows with contiguous elements, a contiguous weight (and bias)."""
    return (
        x.dim() == weight.dim() == 2
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
        and available()
    )


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for tensors `serves` accepts, batch-invariant; float32 (unrounded)
    with `float_out`, else bfloat16."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"input {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    y = torch.empty(m, n, dtype=torch.float32 if float_out else torch.bfloat16)
    if m == 0:
        return y
    bias_ptr = None if bias is None else bias.data_ptr()
    lib = _library()
    assert lib is not None, "bf16_linear called where `serves` is False"
    status = lib.bf16_gemm(x.data_ptr(), x.stride(0), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k, int(float_out))
    if status != 0:
        raise RuntimeError(f"bfloat16 product kernel rejected {tuple(x.shape)} x {tuple(weight.shape)}")
    return y


def _bf16_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if float_out else torch.bfloat16)


_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias=None, bool float_out=False) -> Tensor")
_LIBRARY.impl("bf16_linear", bf16_linear, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::bf16_linear", _bf16_linear_fake, lib=_LIBRARY)
