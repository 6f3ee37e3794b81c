"""Batch-invariant execution (``PAGEDLLM_BATCH_INVARIANT=1``): a request's hidden states, logits and
logprobs are bitwise the same whichever other requests share its steps.

What varies with the batch on CPU, measured: float32 matrix products. oneDNN/MKL computes the rows
of a product in blocks of 4 (and 8, 16 for larger M) and the leftover rows with other kernels, so a
row's result depends on the row count M and on its position in the batch (rows 0-3 of an M=3 product
differ from the same rows of M=4 in the last bits). bfloat16 products measured invariant, and
everything else of the forward is row-wise (norms, rotary, activations) or per request (attention).
The mode pads every 2-D linear input to a multiple of `ROW_MULTIPLE` rows, where each row's result
equals that of any other padded product (checked for M up to 300 at several shapes on an AVX2 EPYC);
since that is a property of the machine's BLAS, it is probed once per weight shape at run time and a
shape that fails the probe runs one row at a time (invariant everywhere, much slower). The padding
costs up to 15 extra rows per product, and the runner runs the eager model under the mode (no
compiled graphs, no native decode path, whose kernels the mode cannot reach): slower, most of all for
one-sequence decode.

By default no such padding runs: seeded sampling draws from the request's own generator only, so a
seeded request samples the same tokens alone or in any batch except where last-bit differences of
its logits move a draw across a token boundary, rare in float32 and more frequent in bfloat16
models with flat distributions.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Rows of a product are padded up to a multiple of this.
ROW_MULTIPLE = 16


def _padded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    return F.linear(x, weight, bias)[:rows]


def _row_by_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


@functools.cache
def padding_is_invariant(out_features: int, in_features: int, dtype: torch.dtype, has_bias: bool) -> bool:
    """Whether padded products of this shape give each row the same bits at any row count and position
    on this machine's BLAS. Measured once per weight shape: the row blocking of the GEMM kernels differs
    between CPUs (and their vector widths), so what holds on one machine is checked, not assumed."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if has_bias else None
    x = torch.randn(3 * ROW_MULTIPLE + 5, in_features, generator=gen).to(dtype)
    full = _padded_linear(x, weight, bias)
    return all(
        torch.equal(_padded_linear(x[start : start + rows], weight, bias), full[start : start + rows])
        for start, rows in [(0, 1), (1, 3), (5, 7), (2, 13), (0, 17), (9, ROW_MULTIPLE + 3), (20, 33)]
    )


class BatchInvariantMode(TorchFunctionMode):
    """Within this mode, `F.linear` on a 2-D input runs on rows padded with zeros to a multiple of
    `ROW_MULTIPLE` (the padding rows are dropped from the result), or one row at a time for a weight
    shape where `padding_is_invariant` found the padded product still batch-dependent."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and args and args[0].dim() == 2:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if padding_is_invariant(weight.shape[0], weight.shape[1], weight.dtype, bias is not None):
                return _padded_linear(x, weight, bias)
            return _row_by_row_linear(x, weight, bias)
        return func(*args, **kwargs)


def numerics(batch_invariant: bool) -> contextlib.AbstractContextManager[object]:
    """What a forward or logits product runs under: the batch-invariant mode when it is on."""
    return BatchInvariantMode() if batch_invariant else contextlib.nullcontext()
