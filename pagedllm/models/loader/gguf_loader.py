"""GGUF checkpoints (llama.cpp): tensors read from a memory map of the file, either kept as stored
(the weights of layers whose GGUF method computes from the blocks, `pagedllm.layers.quant.gguf`:
yielded as `<module>.qweight`, a uint8 [rows, row bytes] view of the mapping with its ggml type in
`ggml_type`) or dequantized to float32 (norms, biases, and everything when the model is loaded
without the GGUF quantization method).

Tensor names are mapped to HF names, so the model's ordinary `load_weights` (with its q/k/v and
gate/up folding) consumes them. llama.cpp's converter permutes the rows of the q and k projections
of "llama" models (from HF's half-split rotary layout to its interleaved one); that permutation is
undone here, exactly as transformers' GGUF loader does, so weights equal HF's.

Mixture-of-experts files store each layer's experts as one 3-D tensor per projection
(`ffn_gate_exps`, `ffn_up_exps`: [E, I, H]; `ffn_down_exps`: [E, H, I]); each is yielded as the E
per-expert HF tensors (views, no copy), which the model's `expert_params_mapping` stacks again.
Mixtral is the "llama" architecture with experts; its HF names are `block_sparse_moe.*`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagedllm.errors import ModelLoadError
from pagedllm.formats.gguf_metadata import GGUFHeader, GGUFTensorInfo, read_gguf_header

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)
# Raw bytes dequantized at once: large enough to amortize numpy's per-call cost, small enough that its
# float32 temporaries stay in the CPU cache (measured: 256 KiB beats 16 KiB and 4 MiB).
_DEQUANT_CHUNK_BYTES = 256 << 10
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Where an architecture's blocks name their norms differently (Gemma's sandwich norms: llama.cpp's
# `ffn_norm` is the pre-feedforward one there, the post-attention norm has its own name).
_ARCH_PER_BLOCK = {
    arch: _PER_BLOCK
    | {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    for arch in ("gemma2", "gemma3")
}
# Phi-3 keeps q/k/v and gate/up fused (`ffn_up` holds both, gate first), as its HF checkpoints do.
_ARCH_PER_BLOCK["phi3"] = _PER_BLOCK | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# OLMo 2 has only the post-norms (and q/k norms over the whole projection, under the usual names).
_ARCH_PER_BLOCK["olmo2"] = _PER_BLOCK | {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Architectures whose norm weights llama.cpp's converter stores plus one (Gemma's `1 + weight`
# norms), undone here as transformers' GGUF loader does.
_NORM_SHIFTED_ARCHS = {"gemma2", "gemma3"}
# Mixture-of-experts tensors: the router, the shared expert (Qwen2-MoE) and the stacked experts, whose
# HF name has the expert id in place of "{}".
_QWEN_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_MIXTRAL_BLOCK = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{}.w2",
}
_MOE_BLOCK = {"llama": _MIXTRAL_BLOCK, "qwen2moe": _QWEN_MOE_BLOCK, "qwen3moe": _QWEN_MOE_BLOCK}
# Architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_ARCHS = {"llama", "mistral", "granite"}
# Tables that are not weights of an HF module: llama.cpp's converter stores llama3 rope scaling as
# per-frequency divisors (and writes no rope scaling metadata), applied by `apply_rope_freq_factors`.
_ROPE_FREQS = "rope_freqs.weight"
_DERIVED = {_ROPE_FREQS}


def read_header(path: Path) -> GGUFHeader:
    """The file's header (metadata and tensor locations), parsed once per file version.

    `gguf.GGUFReader` is not used: it builds numpy views of every metadata element (~5 s for a
    49k-token vocabulary) where only the tensor offsets are needed; the tensors are then read
    straight from a memory map of the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        return read_gguf_header(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _field(header: GGUFHeader, key: str) -> Any:
    if key not in header.metadata:
        raise ModelLoadError(f"GGUF metadata lacks {key!r}")
    return header.metadata[key]


def gguf_architecture(header: GGUFHeader, path: Path) -> str:
    arch = str(_field(header, "general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return arch


def _raw(data: np.ndarray, info: GGUFTensorInfo, path: Path) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor's bytes as stored, [rows, row bytes] (a view of `data`), and its type; a clear error
    for a type not served here or a tensor that runs past the end of the file."""
    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ModelLoadError(f"{path}: tensor {info.name!r} has unknown ggml type {info.ggml_type}") from None
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has type {qtype.name}, which is not supported "
            f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TENSOR_TYPES))})"
        )
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    row_elems = info.dims[0] if info.dims else 1
    num_rows = math.prod(info.dims[1:])
    row_bytes = row_elems // block_elems * block_bytes
    end = info.offset + num_rows * row_bytes
    if row_elems % block_elems:
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has rows of {row_elems} elements, not whole {qtype.name} blocks"
        )
    if end > data.size:
        raise ModelLoadError(f"{path}: tensor {info.name!r} runs past the end of the file (truncated?)")
    # A plain ndarray view: every slice of a np.memmap pays for memmap's __array_finalize__.
    return data[info.offset : end].view(np.ndarray).reshape(num_rows, row_bytes), qtype


def _dequantized(data: np.ndarray, info: GGUFTensorInfo, path: Path) -> np.ndarray:
    """The tensor's values (float32: `gguf.quants.dequantize` widens every type),
    shaped as torch expects (GGUF dims reversed)."""
    raw, qtype = _raw(data, info, path)
    num_rows, row_bytes = raw.shape
    row_elems = info.dims[0] if info.dims else 1
    shape = [int(d) for d in reversed(info.dims)]
    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None:  # F32, F16: a view and a cast
        return dequantize(raw, qtype).reshape(shape)
    # `dequantize` works on groups of 16 rows, a Python loop that costs 5x the arithmetic on a large
    # embedding; the type's row dequantizer over _DEQUANT_CHUNK_BYTES of rows at a time is vectorized numpy.
    out = np.empty((num_rows, row_elems), dtype=np.float32)
    rows_per_chunk = max(1, _DEQUANT_CHUNK_BYTES // row_bytes)
    for start in range(0, num_rows, rows_per_chunk):
        out[start : start + rows_per_chunk] = quant.dequantize_rows(raw[start : start + rows_per_chunk])
    return out.reshape(shape)


def hf_tensor_name(gguf_name: str, arch: str = "") -> str | None:
    """The HF name of a GGUF tensor of a file of architecture `arch` (with "{}" for the expert id of
    stacked experts), or None for tables HF does not store."""
    if gguf_name in _DERIVED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    parts = base.split(".")
    per_block = _ARCH_PER_BLOCK.get(arch, _PER_BLOCK) | _MOE_BLOCK.get(arch, {})
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in per_block:
        return f"model.layers.{parts[1]}.{per_block[parts[2]]}.{suffix}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} is not understood by the loader")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp: reshape(n_head, 2, d/2, ...).swapaxes(1, 2); the inverse swaps back.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _packed(data: np.ndarray, info: GGUFTensorInfo, path: Path, arch: str, n_heads: tuple[int, int]) -> torch.Tensor:
    """A 2-D weight as stored (uint8 [rows, row bytes], q/k rows of "llama" files unpermuted: whole
    rows, so the blocks move intact), its ggml type in `ggml_type`."""
    raw, qtype = _raw(data, info, path)
    if arch in _PERMUTED_ARCHS and info.name.endswith(("attn_q.weight", "attn_k.weight")):
        raw = np.ascontiguousarray(_unpermute_rows(raw, n_heads[0] if ".attn_q." in info.name else n_heads[1]))
    with warnings.catch_warnings():
        # A read-only view of the memory-mapped file: the kernels only read it.
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(raw)
    tensor.ggml_type = int(qtype)  # type: ignore[attr-defined]
    return tensor


def iterate_gguf(path: Path, keep_packed: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, tensor)` for every tensor of the file, dequantized to float32, except the 2-D
    weights whose `<module>.qweight` name `keep_packed` accepts: those are yielded under that name,
    as stored (see `_packed`)."""
    path = Path(path)
    header = read_header(path)
    arch = gguf_architecture(header, path)
    n_head = int(_field(header, f"{arch}.attention.head_count"))
    n_kv_head = int(header.metadata.get(f"{arch}.attention.head_count_kv", n_head))
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for info in header.tensors:
        name = hf_tensor_name(info.name, arch)
        if name is None:
            continue
        packed_name = name.removesuffix(".weight") + ".qweight"
        if keep_packed is not None and len(info.dims) == 2 and "{}" not in name and keep_packed(packed_name):
            yield packed_name, _packed(data, info, path, arch, (n_head, n_kv_head))
            continue
        w = _dequantized(data, info, path)
        if arch in _NORM_SHIFTED_ARCHS and info.name.endswith("norm.weight"):
            w = w - 1
        if arch in _PERMUTED_ARCHS and info.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute_rows(w, n_head if ".attn_q." in info.name else n_kv_head)
        if info.name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores the one-row shared-expert gate as a vector
        with warnings.catch_warnings():
            # Unquantized tensors are read-only views of the memory-mapped file; we only read them.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(w)
        if "{}" in name:
            for expert in range(tensor.shape[0]):
                yield name.format(expert), tensor[expert]
        else:
            yield name, tensor


def rope_freq_factors(path: Path) -> torch.Tensor | None:
    """The file's `rope_freqs` table (float32 [head_dim // 2]), or None when it has none."""
    header = read_header(path)
    for info in header.tensors:
        if info.name == _ROPE_FREQS:
            data = np.memmap(path, dtype=np.uint8, mode="r")
            return torch.from_numpy(np.array(_dequantized(data, info, path), dtype=np.float32).reshape(-1))
    return None


def apply_rope_freq_factors(model: torch.nn.Module, factors: torch.Tensor) -> None:
    """Give every rotary embedding of `model` the GGUF's frequency divisors, unless its config already
    describes llama3 scaling (then the table is derived from it and applying it would scale twice)."""
    from pagedllm.layers.rotary import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            scaling = module.rope_scaling or {}
            if scaling.get("rope_type") == "llama3":
                continue
            try:
                module.set_freq_factors(factors)
            except ValueError as e:
                raise ModelLoadError(f"GGUF {_ROPE_FREQS!r}: {e}") from None
