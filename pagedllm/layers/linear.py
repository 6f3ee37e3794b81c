"""Linear layers named and shaped like vLLM's tensor-parallel ones.

A layer holds only shapes and sharding; its `quant_method` (`LinearMethodBase`, chosen by the
`QuantizationConfig` for the layer's prefix, else `UnquantizedLinearMethod`) creates its weights and
computes its product. Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])`
that copies a checkpoint tensor into it (converting the dtype on the way: the only copy of the weight
at load time), taking this rank's slice: `ColumnParallelLinear` splits the output rows across the
tensor-parallel ranks, `RowParallelLinear` the input columns (its outputs are summed across ranks).
Merged layers take the HF pieces one at a time: `QKVParallelLinear` its "q"/"k"/"v" shards and
`MergedColumnParallelLinear` its numbered shards (gate=0, up=1), each into its rows of the fused
weight, so one GEMM serves all of them at run time.

The rank and world size come from `pagedllm.distributed.parallel_state` (the tensor-parallel group).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import parallel_state
from pagedllm.layers import skinny_gemm
from pagedllm.layers.quant.base import LinearMethodBase, WeightLoader, set_weight_loader

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig

ShardId = str | int


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, except for a single row inside a compiled graph (a one-sequence decode step), where
    it is written as a multiply-reduce that Inductor turns into one streaming kernel, which reads the
    weights faster than the BLAS matrix-vector product (figures: benchmarks/RESULTS.md, "Figures behind
    code choices"), and single-stream decode is bound by reading every weight once per token; and for
    2 to 8 rows on the CPU (a few decodes, or a request verifying drafted tokens), which go to the
    few-row kernel (`skinny_gemm`) for the same reason."""
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
    if skinny_gemm.serves(x, weight, bias):
        return torch.ops.pagedllm.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} does not match parameter {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _shard(loaded_weight: torch.Tensor, dim: int, index: int, size: int, parts: int) -> torch.Tensor:
    """Part `index` (of `parts` parts of `size` each) along `dim` of a checkpoint tensor, which must
    hold exactly the parts."""
    if loaded_weight.dim() <= dim or loaded_weight.shape[dim] != size * parts:
        raise ValueError(
            f"weight shape {tuple(loaded_weight.shape)} does not match {parts} x {size} along dimension {dim}"
        )
    return loaded_weight if parts == 1 else loaded_weight.narrow(dim, index * size, size)


def _check_fused(loaded_weight: torch.Tensor, rows: int) -> None:
    if loaded_weight.dim() == 0 or loaded_weight.shape[0] != rows:
        raise ValueError(f"fused weight shape {tuple(loaded_weight.shape)} does not have {rows} rows")


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size ({parts})")
    return total // parts


class UnquantizedLinearMethod(LinearMethodBase):
    """A dense weight in the activation dtype; the product is `linear` (`F.linear`, or the single-row
    multiply-reduce inside a compiled graph)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        layer.register_parameter("weight", set_weight_loader(nn.Parameter(weight), weight_loader))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.weight  # type: ignore[return-value]


class LinearBase(nn.Module):
    """`y = x @ W^T (+ b)` with `W` of shape [output_size, input_size] (this rank's part of it), the
    weights and product delegated to `quant_method`."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        # The activation dtype: the loader builds the model under its target default dtype.
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    def _create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias_size: int | None
    ) -> None:
        """The weights through the method, and the bias (`bias_size` rows, None: no bias) here."""
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, self.params_dtype, self.weight_loader
        )
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            bias = nn.Parameter(torch.empty(bias_size, dtype=self.params_dtype))
            self.bias: nn.Parameter | None = set_weight_loader(bias, self.weight_loader)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}, method={type(self.quant_method).__name__}"
        )


class ColumnParallelLinear(LinearBase):
    """The output dimension split across ranks: each holds `output_size / tp` rows of `W` (and of
    `b`), and its output is that slice of `y` (consumed sharded, never gathered here)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
        output_sizes: list[int] | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix, params_dtype)
        self.output_sizes = list(output_sizes or [output_size])
        partition_sizes = [
            _divide(s, self.tp_size, f"{prefix or 'linear'} output size") for s in self.output_sizes
        ]
        self._create_weights(input_size, partition_sizes, sum(partition_sizes) if bias else None)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        default_weight_loader(param, _shard(loaded_weight, 0, self.tp_rank, param.shape[0], self.tp_size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused along the output dimension; each
    rank holds its slice of every one of them, in order."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias, quant_config, prefix, params_dtype, output_sizes=output_sizes
        )

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that stores the projections already fused
            _check_fused(loaded_weight, sum(self.output_sizes))
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), i)
                offset += size
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"unknown shard id {shard_id!r} of {len(self.output_sizes)} merged projections")
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = _shard(loaded_weight, 0, self.tp_rank, size, self.tp_size)
        default_weight_loader(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused: output rows are [q | k | v] of this rank's heads.
    With more ranks than key/value heads, each key/value head is replicated on `tp / kv_heads` ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, _divide(tp_size, total_num_kv_heads, "tp size")
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of key/value heads")
            self.num_kv_head_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total_q, total_kv = total_num_heads * head_size, total_num_kv_heads * head_size
        # The full (all ranks) sizes: each rank's partition is [q_size, kv_size, kv_size].
        sizes = [total_q, self.kv_size * tp_size, self.kv_size * tp_size]
        super().__init__(
            hidden_size, total_q + 2 * total_kv, bias, quant_config, prefix, params_dtype, output_sizes=sizes
        )
        # shard id -> (first row in the fused weight, rows, which part of the checkpoint tensor, of how many)
        kv_part, kv_parts = self.tp_rank // self.num_kv_head_replicas, tp_size // self.num_kv_head_replicas
        self._shards = {
            "q": (0, self.q_size, self.tp_rank, tp_size),
            "k": (self.q_size, self.kv_size, kv_part, kv_parts),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_part, kv_parts),
        }

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that stores q, k and v already fused
            total_q, total_kv = (
                self.total_num_heads * self.head_size,
                self.total_num_kv_heads * self.head_size,
            )
            _check_fused(loaded_weight, total_q + 2 * total_kv)
            for sid, start, size in (
                ("q", 0, total_q),
                ("k", total_q, total_kv),
                ("v", total_q + total_kv, total_kv),
            ):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), sid)
            return
        if shard_id not in self._shards:
            raise ValueError(f"unknown QKV shard id {shard_id!r}")
        offset, size, part, parts = self._shards[shard_id]  # type: ignore[index]
        default_weight_loader(param.data.narrow(0, offset, size), _shard(loaded_weight, 0, part, size, parts))


class RowParallelLinear(LinearBase):
    """The input dimension split across ranks: each holds `input_size / tp` columns of `W` and
    multiplies its slice of `x`; the partial outputs are summed across ranks, `b` added once (by rank 0)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix, params_dtype)
        self._create_weights(
            _divide(input_size, self.tp_size, f"{prefix or 'linear'} input size"),
            [output_size],
            output_size if bias else None,
        )

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}")
        if param is not self.bias:  # the bias is added once to the summed output: every rank holds it whole
            loaded_weight = _shard(loaded_weight, 1, self.tp_rank, param.shape[1], self.tp_size)
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1:
            out = parallel_state.tensor_model_parallel_all_reduce(out)
        return out
