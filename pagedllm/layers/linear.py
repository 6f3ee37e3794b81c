"""Linear layers named and shaped like vLLM's tensor-parallel ones, at tensor-parallel size 1.

Each layer has a `weight_loader(param, loaded_weight[, shard_id])` that copies a checkpoint tensor
into one of its parameters (converting the dtype on the way: the only copy of the weight at load time). Merged
layers take the HF pieces one at a time: `QKVParallelLinear` its "q"/"k"/"v" shards, and
`MergedColumnParallelLinear` its numbered shards (gate=0, up=1), each into its rows of the fused weight,
so one GEMM serves all of them at run time.

Tensor parallelism is not implemented yet: `tp_size > 1` raises instead of silently running replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def check_tp_size(tp_size: int) -> None:
    if tp_size != 1:
        raise NotImplementedError(
            f"tensor_parallel_size={tp_size} is not supported yet (only 1): the linear layers are not sharded"
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, except for a single row inside a compiled graph (a one-sequence decode step), where
    it is written as a multiply-reduce that Inductor turns into one streaming kernel: on 2 Zen 4 cores
    that reads bf16 weights at ~25 GB/s where the BLAS matrix-vector product reaches ~13 GB/s, and
    single-stream decode is bound by reading every weight once per token."""
    if x.dim() == 2 and x.shape[0] == 1 and torch.compiler.is_compiling():
        # Store the input row (in float32) before the reduction reads it: Inductor otherwise inlines
        # a pointwise producer (the RMSNorm before the QKV and gate/up projections) into the
        # reduction loop and recomputes it for every output row, ~12% slower on those projections.
        # `as_strided` onto the row's own layout changes nothing but needs a stored buffer.
        row = x.float().contiguous()
        row = row.as_strided(row.shape, row.stride())
        y = (weight.float() * row).sum(-1, keepdim=True).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} does not match parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


class LinearBase(nn.Module):
    """`y = x @ W^T (+ b)` with `W` of shape [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_size: int = 1) -> None:
        super().__init__()
        check_tp_size(tp_size)
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(output_size))
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks (at TP=1: the whole weight)."""


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks, outputs all-reduced (at TP=1: no reduction needed)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output dimension."""

    def __init__(
        self, input_size: int, output_sizes: list[int], bias: bool = False, tp_size: int = 1
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, tp_size=tp_size)

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        offset = sum(self.output_sizes[:shard_id])
        default_weight_loader(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded_weight)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused: output rows are [q | k | v]."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        tp_size: int = 1,
    ) -> None:
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = total_num_kv_heads or total_num_heads
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias=bias, tp_size=tp_size)

    def weight_loader(  # type: ignore[override]
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | None = None
    ) -> None:
        if shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        offsets = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        if shard_id not in offsets:
            raise ValueError(f"unknown QKV shard id {shard_id!r}")
        start, size = offsets[shard_id]
        default_weight_loader(param.data.narrow(0, start, size), loaded_weight)
