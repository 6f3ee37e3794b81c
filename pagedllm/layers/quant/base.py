"""What a layer delegates to its quantization method: creating its weights, fixing them up after the
checkpoint is loaded, and computing its product.

A `QuantizationConfig` (the interface in `pagedllm.quant_interface`, implemented by each format's
module here) picks the method of each layer by its prefix (`get_quant_method(layer, prefix)`);
unquantized layers use `UnquantizedLinearMethod`. Quantized
formats (GGUF kept packed, AWQ, GPTQ, fp8) and LoRA wrappers are further methods.
"""

from __future__ import annotations

import ctypes
from abc import abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagedllm.quant_interface import QuantizeMethodBase


class WeightLoader(Protocol):
    """`weight_loader(param, loaded_weight[, shard_id])`: copy a checkpoint tensor into (this rank's
    slice of, and the fused shard `shard_id` of) `param`."""

    def __call__(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None: ...


class QuantGraphKey:
    """Quantization's part of a compiled block's key (`pagedllm.layers.graph_key`): the `constants` of
    each of the block's layers, in order (what `apply` bakes into the trace besides the tensors)."""

    def owns(self, obj: object) -> bool:
        return isinstance(obj, QuantizeMethodBase)

    def graph_key(self, block: nn.Module) -> Hashable:
        return tuple(
            m.quant_method.constants(m)
            for m in block.modules()
            if isinstance(getattr(m, "quant_method", None), QuantizeMethodBase)
        )

    def step_graph_key(self) -> Hashable:
        return None


class LinearMethodBase(QuantizeMethodBase):
    """The method of a linear layer (`y = x @ W^T + b`)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register this rank's weight parameters on `layer` (each with `weight_loader` as its
        `weight_loader` attribute). `output_partition_sizes` are the fused outputs' sizes on this rank."""

    def dense_weight(self, layer: nn.Module) -> torch.Tensor | None:
        """The [out, in] matrix whose plain product `apply` computes, for code that runs the product
        itself (the native decode path); None when `apply` computes anything else (a method that
        overrides `apply` of one that returns a matrix must override this too)."""
        return None

    def native_matvec(self, layer: nn.Module) -> NativeMatvec | None:
        """The native matrix-vector entry of a layer whose weight is not a plain matrix (quantized),
        for the native decode path: its float result, rounded to the activations' dtype, is what
        `apply` computes for one row without the bias. None: no such entry (the default)."""
        return None

    def may_add_to_base(self) -> bool:
        """Whether `apply` can ever add to the base product (an adapter wrapper, active or not): code
        that means to run every step itself cannot then."""
        return False

    def adds_to_base(self) -> bool:
        """Whether this step's `apply` adds anything to the product of `dense_weight` / `native_matvec`
        (an adapter some token of the step runs): code that runs that product itself steps aside then."""
        return False


@dataclass(frozen=True)
class NativeMatvec:
    """A quantized layer's matrix-vector product as native code calls it (the single-sequence decode
    path): `fn` is the address of a C function `int fn(const void *desc, const float *x, float *y)`
    computing y [out] = W x [in] in float (0 on success) from its own kernel library, `desc` the
    address of the descriptor of the layer's weight it reads. `keep` holds what those addresses point
    into (the descriptor, the arrays and tensors it references): valid while this object lives and
    the layer keeps its weights."""

    fn: int
    desc: int
    keep: object


def matvec_entry(lib: ctypes.CDLL, name: str, desc: ctypes.Structure, *keep: object) -> NativeMatvec:
    """The entry `name` of the loaded kernel library `lib` called with `desc` (kept alive with `keep`)."""
    fn = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    assert fn is not None
    return NativeMatvec(fn, ctypes.addressof(desc), (desc, *keep))


def set_weight_loader(param: nn.Parameter, weight_loader: WeightLoader) -> nn.Parameter:
    """Attach the loader to the parameter, where the generic model loader looks for it."""
    param.weight_loader = weight_loader  # type: ignore[attr-defined]
    return param
