"""GGUF weights kept as stored: linear layers (and the embedding / LM head) computed from the
llama.cpp blocks, never from a float copy.

The loader (`pagedllm.models.loader.gguf_loader`) yields each such tensor as `<module>.qweight`: a
uint8 [rows, row bytes] view of the memory-mapped file, its ggml type in `ggml_type`. A linear layer
keeps one tensor per fused part (q/k/v, gate/up: llama.cpp stores them apart, possibly of different
types, as Q4_K_M does), each a buffer `qweight_<i>` that still points into the file's mapping; one
kernel call multiplies their row-concatenation.

The product (`torch.ops.pagedllm.gguf_linear`, opaque to torch.compile) picks its path by the number
of rows and the parts' types (`int8_max_rows`): few rows, int8 dot products on activations quantized
per 32-element block (gguf_kernels.c; each weight block is read once for all rows); more, the
weight dequantized once per call and multiplied by a float GEMM, which wins once the dequantization is
spread over enough rows: for bf16 activations on CPUs with AVX512-BF16 and no AMX, panels of weight
rows dequantized to bf16 into an L2-resident buffer and multiplied by `vdpbf16ps`
(`gguf_native.matmul_panels`, `takes_panels`); elsewhere tiles of weight rows into torch's GEMM
(`tiles.tiled_product`, shared with AWQ/GPTQ and fp8): bf16 tiles for bf16 activations on CPUs with
native bf16 dot products (AMX: oneDNN's tile GEMM), float32 tiles otherwise (`tiles.gemm_dtype`).

The embedding gathers the rows it needs and dequantizes only those; a tied LM head shares the
embedding's quantized parameter and multiplies by it directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.layers.embedding import VocabParallelEmbedding
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quant import gguf_native
from pagedllm.layers.quant.base import (
    LinearMethodBase,
    NativeMatvec,
    QuantizeMethodBase,
    WeightLoader,
    set_weight_loader,
)
from pagedllm.layers.quant.tiles import gemm_dtype, tiled_product
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.quant_interface import QuantizationConfig

# Activation rows up to which the int8 kernel beats dequantized tiles + GEMM, per ggml type (a layer
# of several types takes the smallest), from benchmarks/quant_linear.py (figures: benchmarks/RESULTS.md,
# "Figures behind code choices"). Ties go to the kernel, which reads the weight once where a real
# model's float tiles do not stay cached.
INT8_MAX_ROWS = 8
_INT8_MAX_ROWS_BY_TYPE = {GGMLQuantizationType.Q4_0: 12, GGMLQuantizationType.Q8_0: 16, GGMLQuantizationType.Q2_K: 12}
# The same against the bf16 panel kernel (`takes_panels`), whose dequantization is cheaper than the
# tiles' and needs no GEMM call: measured one thread on Zen 5 (benchmarks/RESULTS.md, 2026-12-07 night).
PANELS_INT8_MAX_ROWS = 5
_PANELS_INT8_MAX_ROWS_BY_TYPE = {GGMLQuantizationType.Q8_0: 6, GGMLQuantizationType.Q6_K: 3}


def int8_max_rows(types: Sequence[int], panels: bool) -> int:
    """Activation rows up to which a layer of parts of ggml `types` takes the int8 kernel, against the
    panel kernel where `panels` (see `takes_panels`), else against the tiles."""
    if panels:
        return min(_PANELS_INT8_MAX_ROWS_BY_TYPE.get(t, PANELS_INT8_MAX_ROWS) for t in types)
    return min(_INT8_MAX_ROWS_BY_TYPE.get(t, INT8_MAX_ROWS) for t in types)


def takes_panels(activations: torch.dtype) -> bool:
    """Whether products of more rows than `int8_max_rows` take the bf16 panel kernel: bf16 activations
    where the kernels have AVX512-BF16 and the CPU no AMX (whose tiles torch's bf16 GEMM of the
    dequantized tiles uses, faster than the vector kernel)."""
    return (
        gemm_dtype(activations) == torch.bfloat16
        and gguf_native.has_panels()
        and not CpuPlatform.has_amx_bf16()
    )


def gguf_linear(
    x: torch.Tensor, shards: list[torch.Tensor], types: list[int], out_features: int
) -> torch.Tensor:
    """`x @ W^T` for `x` [M, k] and `W` the row-concatenation of the quantized `shards`."""
    k = x.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    panels = takes_panels(x.dtype)
    if m <= int8_max_rows(types, panels):
        out = torch.empty(m, out_features, dtype=x.dtype)
        if m:
            gguf_native.matmul(x, shards, types, k, out)
        return out
    if panels:
        out = torch.empty(m, out_features, dtype=x.dtype)
        gguf_native.matmul_panels(x, shards, types, k, out)
        return out
    starts = list(itertools.accumulate((s.shape[0] for s in shards), initial=0))

    def widen(rows: slice, tile: torch.Tensor) -> None:
        # The tile's rows may span parts: each part's overlap dequantized into its place.
        for start, shard, qtype in zip(starts, shards, types):
            lo, hi = max(rows.start, start), min(rows.stop, start + shard.shape[0])
            if lo < hi:
                gguf_native.dequantize_rows(
                    shard[lo - start : hi - start], qtype, k, tile[lo - rows.start : hi - rows.start]
                )

    return tiled_product(x, out_features, widen, gemm_dtype(x.dtype))


def _gguf_linear_fake(
    x: torch.Tensor, shards: list[torch.Tensor], types: list[int], out_features: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_LIBRARY = torch.library.Library("pagedllm", "FRAGMENT")
_LIBRARY.define("gguf_linear(Tensor x, Tensor[] shards, int[] types, int out_features) -> Tensor")
_LIBRARY.impl("gguf_linear", gguf_linear, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::gguf_linear", _gguf_linear_fake, lib=_LIBRARY)


def _product(
    x: torch.Tensor, shards: Sequence[torch.Tensor], types: Sequence[int], out_features: int
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.pagedllm.gguf_linear(rows, list(shards), list(types), out_features)
    return out.reshape(*x.shape[:-1], out_features)


def check_packed(tensor: torch.Tensor, rows: int, k: int) -> int:
    """The ggml type of a loaded packed tensor, after checking it holds `rows` rows of `k` elements."""
    qtype = getattr(tensor, "ggml_type", None)
    if tensor.dtype != torch.uint8 or qtype is None:
        raise ValueError("expected a GGUF tensor kept packed (the GGUF loader yields them)")
    expected = gguf_native.row_bytes(qtype, k)
    if tensor.dim() != 2 or tensor.shape[0] != rows or tensor.shape[1] != expected:
        raise ValueError(
            f"packed shape {tuple(tensor.shape)} is not {rows} rows of {k} elements of ggml type {qtype} "
            f"({expected} bytes each)"
        )
    return int(qtype)


def _placeholder(loader: WeightLoader) -> nn.Parameter:
    return set_weight_loader(nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False), loader)


class GGUFLinearMethod(LinearMethodBase):
    """A linear layer whose weight parts stay GGUF blocks (see the module docstring)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if layer.tp_size != 1:
            raise ValueError("GGUF layers kept quantized run on one tensor-parallel rank")
        layer.gguf_sizes = list(output_partition_sizes)
        layer.gguf_types = [-1] * len(output_partition_sizes)
        # Only the name the loader looks up (`<module>.qweight`); the parts land in buffers.
        layer.register_parameter(
            "qweight", _placeholder(lambda p, w, shard_id=None: self._load(layer, w, shard_id))
        )

    def _load(self, layer: nn.Module, tensor: torch.Tensor, shard_id: str | int | None) -> None:
        sizes = layer.gguf_sizes
        if shard_id is None:
            if len(sizes) != 1:  # a file that stores the parts fused (Phi-3): one part of all rows
                layer.gguf_sizes = sizes = [sum(sizes)]
                layer.gguf_types = [-1]
            index = 0
        else:
            index = "qkv".index(shard_id) if isinstance(shard_id, str) else shard_id
            if not 0 <= index < len(sizes):
                raise ValueError(f"unknown shard {shard_id!r} of {len(sizes)} fused parts")
        layer.gguf_types[index] = check_packed(tensor, sizes[index], layer.input_size_per_partition)
        layer.register_buffer(f"qweight_{index}", tensor, persistent=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = [i for i, t in enumerate(layer.gguf_types) if t < 0]
        if missing:
            raise ValueError(f"{layer.prefix}: GGUF parts {missing} were not loaded")

    def constants(self, layer: nn.Module) -> tuple[object, ...]:
        return (*layer.gguf_types, *layer.gguf_sizes)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shards = [getattr(layer, f"qweight_{i}") for i in range(len(layer.gguf_types))]
        out = _product(x, shards, layer.gguf_types, layer.output_size_per_partition)
        return out if bias is None else out + bias

    def native_matvec(self, layer: nn.Module) -> NativeMatvec | None:
        """`gguf_matvec`: the one-row int8 product of every part (the native decode path's entry)."""
        shards = [getattr(layer, f"qweight_{i}") for i in range(len(layer.gguf_types))]
        return gguf_native.matvec_entry(shards, layer.gguf_types, layer.input_size_per_partition)

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(getattr(layer, f"qweight_{i}").numel() for i in range(len(layer.gguf_types)))


class GGUFEmbeddingMethod(QuantizeMethodBase):
    """The token embedding kept as GGUF blocks: a lookup dequantizes only the rows it gathers; as the
    (tied or own) LM head, the quantized product. A tied head shares the `qweight` parameter."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.register_parameter("qweight", _placeholder(self._load))

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"an embedding has no shard {shard_id!r}")
        # Read by every module sharing the parameter (a tied LM head) after loading.
        param.ggml_type = check_packed(tensor, param.num_rows, param.embedding_dim)  # type: ignore[attr-defined]
        param.data = tensor

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.gguf_type = layer.qweight.ggml_type

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), layer.embedding_dim, dtype=layer.gguf_dtype)
        gguf_native.dequantize_rows(layer.qweight, layer.gguf_type, layer.embedding_dim, out, ids)
        return out.reshape(*input_ids.shape, layer.embedding_dim)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _product(x, [layer.qweight], [layer.gguf_type], layer.num_embeddings)


def embedding_method(layer: nn.Module) -> GGUFEmbeddingMethod:
    """The method of a GGUF embedding `layer` (its qweight knows its own shape for the load check)."""
    method = GGUFEmbeddingMethod()
    method.create_weights(layer)
    # The activation dtype: the loader builds the model under its target default dtype.
    layer.gguf_dtype = torch.get_default_dtype()
    layer.qweight.num_rows = layer.num_embeddings
    layer.qweight.embedding_dim = layer.embedding_dim
    return method


class GGUFQuantizationConfig(QuantizationConfig):
    """llama.cpp block quantization (Q4_0, Q4_1, Q8_0, K-quants...) read from a .gguf file."""

    name = "gguf"

    def get_min_capability(self) -> int:
        return 60

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # Linear layers and the token embedding (with a tied or own LM head) keep the file's blocks;
        # other layers (norms, mixture-of-experts weights) get dequantized tensors from the loader.
        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return embedding_method(layer)
        return None
