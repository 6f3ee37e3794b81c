"""AWQ and GPTQ linear layers: 4-bit group-quantized weights computed from their packed nibbles, never
from a float copy.

The checkpoint's `qweight` / `qzeros` / `scales` (and GPTQ's `g_idx`) of each fused part (q/k/v,
gate/up) are kept as loaded until every part is in; `process_weights_after_loading` then reads them
(`int4_layouts`) into the kernels' layout, the parts' rows concatenated: `int4_qweight` uint8
[out, in/2], `int4_scales` float16 and `int4_zeros` uint8 [out, in/group], and for act-order GPTQ the
input permutation `int4_perm` that makes groups contiguous (the activations are gathered by it).

The product (`torch.ops.pagedllm.int4_linear`, opaque to torch.compile) picks its path by the number of
activation rows: up to `MATMUL_MAX_ROWS`, the native kernel that widens nibbles in registers (decode);
above, tiles of weight rows dequantized to float32 and multiplied by torch's GEMM (`tiles`,
prompts), which wins once a tile's dequantization is spread over enough rows. The native
single-sequence decode path calls the same kernel for one row (`native_matvec`: `int4_matvec`, which
gathers the input by the act-order permutation first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.formats.quant_params import int4_params
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quant import int4_native
from pagedllm.layers.quant.base import (
    LinearMethodBase,
    NativeMatvec,
    QuantizeMethodBase,
    WeightLoader,
    set_weight_loader,
)
from pagedllm.layers.quant.int4_layouts import (
    act_order_permutation,
    awq_to_int4,
    checkpoint_problem,
    gptq_to_int4,
    pack_int4,
    packed_shapes,
)
from pagedllm.layers.quant.int4_native import Int4Weight
from pagedllm.layers.quant.tiles import tiled_product
from pagedllm.quant_interface import CheckpointTensors, QuantizationConfig

# Activation rows up to which the native kernel beats dequantized tiles + GEMM (benchmarks/quant_linear.py;
# figures: benchmarks/RESULTS.md, "Figures behind code choices").
MATMUL_MAX_ROWS = 8


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """`x @ W^T` for `x` [M, in] and the 4-bit weight W [out, in] (its columns in `perm` order)."""
    if perm is not None:
        x = x.index_select(1, perm)
    m, n = x.shape[0], qweight.shape[0]
    if m <= MATMUL_MAX_ROWS:
        out = torch.empty(m, n, dtype=torch.float32)
        if m:
            int4_native.matmul(x.float().contiguous(), Int4Weight(qweight, scales, zeros, group), out)
        return out.to(x.dtype)

    def widen(rows: slice, tile: torch.Tensor) -> None:
        int4_native.dequantize_rows(Int4Weight(qweight[rows], scales[rows], zeros[rows], group), tile)

    return tiled_product(x, n, widen)


def _int4_linear_fake(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    perm: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define(
    "int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, Tensor? perm, int group) -> Tensor"
)
_LIBRARY.impl("int4_linear", int4_linear, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::int4_linear", _int4_linear_fake, lib=_LIBRARY)


class Int4LinearMethod(LinearMethodBase):
    """A linear layer of an AWQ or GPTQ checkpoint (see the module docstring)."""

    def __init__(self, config: Int4QuantizationConfig) -> None:
        self.config = config

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if layer.tp_size != 1:
            raise ValueError(f"{self.config.name.upper()} layers run on one tensor-parallel rank")
        k, group = input_size_per_partition, self.config.group_for(input_size_per_partition)
        if k % group or group % 32 or any(n % 8 for n in output_partition_sizes):
            raise ValueError(
                f"{layer.prefix}: {self.config.name.upper()} needs the input width ({k}) to be a multiple of "
                f"the group size ({group}), itself a multiple of 32, and output sizes "
                f"{output_partition_sizes} multiples of 8"
            )
        layer.int4_group = group
        layer.int4_sizes = list(output_partition_sizes)
        # Each checkpoint tensor of each fused part, as loaded, until process_weights_after_loading.
        names = packed_shapes(self.config.name == "awq", k, 8, group)
        layer.int4_parts = {name: [None] * len(output_partition_sizes) for name in names}
        for name in names:
            loader = self._loader(layer, name)
            param = nn.Parameter(torch.empty(0, dtype=torch.int32), requires_grad=False)
            layer.register_parameter(name, set_weight_loader(param, loader))

    def _loader(self, layer: nn.Module, name: str) -> WeightLoader:
        def load(param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
            sizes = layer.int4_sizes
            if shard_id is None:
                if len(sizes) != 1:  # a checkpoint that stores the parts fused: one part of all rows
                    layer.int4_sizes = sizes = [sum(sizes)]
                    layer.int4_parts = {key: [None] for key in layer.int4_parts}
                index = 0
            else:
                index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
            k, awq = layer.input_size_per_partition, self.config.name == "awq"
            expected = packed_shapes(awq, k, sizes[index], layer.int4_group)[name]
            if tuple(tensor.shape) != expected:
                raise ValueError(f"shape {tuple(tensor.shape)} is not the expected {expected}")
            # A copy: the reader's tensor is a view of the file valid until the next one.
            layer.int4_parts[name][index] = tensor.clone()

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = layer.int4_parts
        missing = [f"{name}[{i}]" for name, ts in parts.items() for i, t in enumerate(ts) if t is None]
        if missing:
            raise ValueError(f"{layer.prefix}: {self.config.name.upper()} tensors {missing} were not loaded")
        convert = awq_to_int4 if self.config.name == "awq" else gptq_to_int4
        # (q, z, s) of each part, then each concatenated over the parts' rows.
        converted = [convert(*tensors) for tensors in zip(parts["qweight"], parts["qzeros"], parts["scales"])]
        q, z, s = (torch.cat(pieces) for pieces in zip(*converted))
        perm = None
        if self.config.desc_act and "g_idx" in parts:
            first = parts["g_idx"][0]
            if any(not torch.equal(first, g) for g in parts["g_idx"][1:]):
                raise ValueError(f"{layer.prefix}: the fused parts have different g_idx (act-order)")
            try:
                perm = act_order_permutation(first, layer.int4_group)
            except ValueError as e:
                raise ValueError(f"{layer.prefix}: {e}") from None
            if perm is not None:
                q = q[:, perm]
        del layer.int4_parts
        layer.register_buffer("int4_qweight", pack_int4(q), persistent=False)
        layer.register_buffer("int4_scales", s, persistent=False)
        layer.register_buffer("int4_zeros", z.to(torch.uint8), persistent=False)
        layer.register_buffer("int4_perm", perm, persistent=False)

    def constants(self, layer: nn.Module) -> tuple[object, ...]:
        return (layer.int4_group, layer.int4_perm is not None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.pagedllm.int4_linear(
            rows, layer.int4_qweight, layer.int4_scales, layer.int4_zeros, layer.int4_perm, layer.int4_group
        )
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def native_matvec(self, layer: nn.Module) -> NativeMatvec | None:
        weight = Int4Weight(layer.int4_qweight, layer.int4_scales, layer.int4_zeros, layer.int4_group)
        return int4_native.matvec_entry(weight, layer.int4_perm)


class Int4QuantizationConfig(QuantizationConfig):
    """4-bit group quantization of the linear layers (AWQ, GPTQ), its parameters read from the
    checkpoint's `quantization_config` (config.json) as vLLM reads them."""

    def __init__(self) -> None:
        self.bits = 4
        self.group_size = 128
        self.desc_act = False
        self.modules_to_not_convert: list[str] = []

    def get_min_capability(self) -> int:
        return 0

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def group_for(self, input_size: int) -> int:
        """The group size of a layer `input_size` wide (-1: one group over the whole input)."""
        return input_size if self.group_size == -1 else self.group_size

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        params = int4_params(model, self.name, hf_config)
        self.bits, self.group_size, self.desc_act = params.bits, params.group_size, params.desc_act
        self.modules_to_not_convert = params.modules_to_not_convert

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # The linear layers of the decoder; the embedding and the LM head stay float, as AutoAWQ and
        # GPTQModel leave them, and so do the modules the checkpoint lists as not converted.
        if isinstance(layer, LinearBase) and not any(m in prefix for m in self.modules_to_not_convert):
            return Int4LinearMethod(self)
        return None

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        for name in sorted(n for n in tensors if n.endswith(".qweight")):
            problem = checkpoint_problem(self, name.removesuffix(".qweight"), tensors)
            if problem:
                raise ValueError(f"{tensors[name][0]}: {problem}")

    def compute_hash(self) -> str:
        return f"{self.name}-{self.bits}-{self.group_size}-{self.desc_act}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act})"
        )


class AWQQuantizationConfig(Int4QuantizationConfig):
    """AutoAWQ's GEMM-layout checkpoints (see `pagedllm.layers.quant.int4_layouts`)."""

    name = "awq"


class GPTQQuantizationConfig(Int4QuantizationConfig):
    """AutoGPTQ / GPTQModel checkpoints in the v1 "gptq" format, with or without act-order."""

    name = "gptq"
