"""fp8 linear layers: float8 e4m3 weights with one float32 scale per output row.

Online (`quantization="fp8"` on an unquantized checkpoint): each weight is loaded as usual, then stored
as e4m3 (each row's largest magnitude maps to e4m3's largest, 448), and the float weight is dropped.
From an fp8 checkpoint: the e4m3 `weight` is loaded as stored and its `weight_scale` (one per tensor, or
one per output channel) is expanded to one per row of the fused layer, so q/k/v or gate/up parts with
different per-tensor scales share one product.

The product (`torch.ops.pagedllm.fp8_linear`, opaque to torch.compile) widens tiles of weight rows to
float32 (a lookup-table C kernel, kernels/cpu/fp8_kernels.c) and multiplies them with torch's GEMM (`tiles`), for
every step size: fp8 costs a quarter of float32's bytes to keep, but each step widens it again.
The native single-sequence decode path instead multiplies one row by the e4m3 bytes directly
(`fp8_matvec`, declared by `native_matvec`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import nn

from pagedllm.formats.quant_params import fp8_params
from pagedllm.kernels import build
from pagedllm.kernels.abi import Fp8Matvec
from pagedllm.layers.linear import LinearBase, UnquantizedLinearMethod
from pagedllm.layers.quant.base import (
    NativeMatvec,
    QuantizeMethodBase,
    WeightLoader,
    matvec_entry,
    set_weight_loader,
)
from pagedllm.layers.quant.tiles import tile_rows, tiled_product
from pagedllm.quant_interface import CheckpointTensors, QuantizationConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# The float value of each fp8 bit pattern, the kernel's lookup table.
_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The widening kernel (fp8_kernels.c), or None without a C compiler (torch's copy then widens)."""
    lib = build.cdll(build.FP8)
    if lib is None:
        return None
    lib.fp8_widen_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    lib.fp8_widen_rows.restype = None
    return lib


def widen_rows(weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """`out` (contiguous float32 [rows, in]) = `weight` (contiguous e4m3 rows) * `scale[:, None]`."""
    lib = library()
    if lib is None:
        out.copy_(weight).mul_(scale[:, None])
        return
    n, k = weight.shape
    lib.fp8_widen_rows(weight.data_ptr(), scale.data_ptr(), _VALUES.data_ptr(), n, k, out.data_ptr())


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [out, in], float32 scale [out]) with weight ~= e4m3 * scale[:, None], a row tile at a time
    (no float32 copy of the whole weight)."""
    q = torch.empty(weight.shape, dtype=FP8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    step = tile_rows(weight.shape[1])
    for start in range(0, weight.shape[0], step):
        rows = weight[start : start + step].float()
        s = rows.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
        q[start : start + step] = (rows / s[:, None]).to(FP8)
        scale[start : start + step] = s
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` for `x` [M, in] and W = weight (e4m3 [out, in]) * scale[:, None]."""

    def widen(rows: slice, tile: torch.Tensor) -> None:
        widen_rows(weight[rows], scale[rows], tile)

    return tiled_product(x, weight.shape[0], widen)


def _fp8_linear_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define("fp8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor")
_LIBRARY.impl("fp8_linear", fp8_linear, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::fp8_linear", _fp8_linear_fake, lib=_LIBRARY)


class Fp8OnlineLinearMethod(UnquantizedLinearMethod):
    """Loads the float weight like an unquantized layer, then keeps only its fp8 form."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_rows(layer.weight.detach())
        del layer.weight
        layer.register_buffer("fp8_weight", q, persistent=False)
        layer.register_buffer("fp8_scale", scale, persistent=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.pagedllm.fp8_linear(rows, layer.fp8_weight, layer.fp8_scale)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        return None

    def native_matvec(self, layer: nn.Module) -> NativeMatvec | None:
        """`fp8_matvec`: each e4m3 byte widened in registers (None without a C compiler)."""
        lib = library()
        if lib is None:
            return None
        weight, scale = layer.fp8_weight, layer.fp8_scale
        n, k = weight.shape
        desc = Fp8Matvec(weight.data_ptr(), scale.data_ptr(), _VALUES.data_ptr(), n, k)
        return matvec_entry(lib, "fp8_matvec", desc, weight, scale)


class Fp8CheckpointLinearMethod(Fp8OnlineLinearMethod):
    """A linear layer of an fp8 checkpoint: its e4m3 `weight` and `weight_scale` (per tensor: a scalar,
    or per output channel: [out] or [out, 1]) loaded as stored, then computed as the online layers are.
    With `static_input_scale`, the checkpoint's `input_scale` (a static activation scale) is read and
    dropped: the product keeps the activations in their float dtype (weight-only fp8), which needs none."""

    def __init__(self, static_input_scale: bool) -> None:
        self.static_input_scale = static_input_scale

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if layer.tp_size != 1:
            raise ValueError("fp8 checkpoint layers run on one tensor-parallel rank")
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=FP8), requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, _fp8_only(weight_loader)))
        # [rows, 1]: the layer's loader places each part's scales in its rows, as it places weights.
        scale = nn.Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
        layer.register_parameter("weight_scale", set_weight_loader(scale, _per_row(layer, weight_loader)))
        if self.static_input_scale:
            ignored = nn.Parameter(torch.empty(0), requires_grad=False)
            layer.register_parameter("input_scale", set_weight_loader(ignored, _discard))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight, scale = layer.weight.data, layer.weight_scale.data.reshape(-1).contiguous()
        del layer.weight, layer.weight_scale
        if self.static_input_scale:
            del layer.input_scale
        layer.register_buffer("fp8_weight", weight, persistent=False)
        layer.register_buffer("fp8_scale", scale, persistent=False)


def _fp8_only(weight_loader: WeightLoader) -> WeightLoader:
    """`weight_loader`, refusing anything but e4m3 (a float weight would be rounded without a scale)."""

    def load(param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
        if tensor.dtype != FP8:
            raise ValueError(f"dtype {tensor.dtype} is not the fp8 checkpoint's {FP8}")
        weight_loader(param, tensor, shard_id)

    return load


def _per_row(layer: nn.Module, weight_loader: WeightLoader) -> WeightLoader:
    """`weight_loader` for a `weight_scale`, each scale first expanded to one per row of its part."""

    def load(param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
        sizes = getattr(layer, "output_sizes", [layer.output_size])
        if shard_id is None:
            rows = sum(sizes)
        else:
            rows = sizes["qkv".index(shard_id) if isinstance(shard_id, str) else shard_id]
        scale = tensor.float().reshape(-1)
        if scale.numel() not in (1, rows):
            raise ValueError(
                f"weight_scale of shape {tuple(tensor.shape)} is neither per tensor nor {rows} rows"
            )
        weight_loader(param, scale.expand(rows)[:, None], shard_id)

    return load


def _discard(param: torch.Tensor, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
    """A static activation scale: not needed by weight-only fp8 (see Fp8CheckpointLinearMethod)."""


class Fp8QuantizationConfig(QuantizationConfig):
    """fp8 e4m3 linear layers (`pagedllm.layers.quant.fp8`): online (an unquantized checkpoint's
    weights quantized at load, one scale per output channel), or an fp8 checkpoint's (its config.json
    `quantization_config` says `quant_method: "fp8"`, as vLLM reads it): float8_e4m3fn weights with a
    `weight_scale` per tensor or per output channel. Block-wise scales (`weight_block_size`) are refused."""

    name = "fp8"

    def __init__(self) -> None:
        self.is_checkpoint_fp8_serialized = False
        self.activation_scheme = "dynamic"
        self.ignored_layers: list[str] = []

    def get_min_capability(self) -> int:
        return 0

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        params = fp8_params(model, hf_config)
        if params is None:
            return  # online fp8
        self.is_checkpoint_fp8_serialized = True
        self.activation_scheme, self.ignored_layers = params.activation_scheme, params.ignored_layers

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # The decoder's linear layers; the embedding and the LM head stay in the model dtype, and so
        # do a checkpoint's `ignored_layers` (named as the model names them).
        if not isinstance(layer, LinearBase) or prefix in self.ignored_layers:
            return None
        if self.is_checkpoint_fp8_serialized:
            return Fp8CheckpointLinearMethod(self.activation_scheme == "static")
        return Fp8OnlineLinearMethod()

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        # An fp8 weight is only readable with its scale (`X.weight` -> `X.weight_scale`).
        for name, (path, _, dtype) in sorted(tensors.items()):
            if dtype == torch.float8_e4m3fn and f"{name}_scale" not in tensors:
                raise ValueError(f"{path}: fp8 tensor {name!r} has no {name + '_scale'!r} (its scale)")

    def compute_hash(self) -> str:
        return f"{self.name}-{self.is_checkpoint_fp8_serialized}-{self.activation_scheme}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(checkpoint={self.is_checkpoint_fp8_serialized}, "
            f"activation_scheme={self.activation_scheme!r})"
        )
