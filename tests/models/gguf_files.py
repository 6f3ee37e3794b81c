"""Test helper: write small GGUF files with chosen tensor types (llama.cpp layout) via `gguf`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

# Byte layout of one 256-element super-block: (size, offsets of its float16 scale fields).
_K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype in _K_QUANTS:
        # gguf can only dequantize K-quants: write random blocks with small finite scales instead.
        size, scale_offsets = _K_QUANTS[qtype]
        blocks = rng.integers(0, 256, size=(w.size // 256, size), dtype=np.uint8)
        for off in scale_offsets:
            scales = rng.uniform(1e-4, 1e-3, size=blocks.shape[0]).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(w.shape[0], -1)
    return quantize(w, qtype)


def llama_cpp_rope_freqs(head_dim: int, base: float, rope: dict[str, float]) -> np.ndarray:
    """The `rope_freqs` table llama.cpp's converter writes for a llama3 `rope_scaling` (the divisor of
    each rotary frequency), computed from its definition, independently of pagedllm's rotary code."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_llama_gguf(
    path: Path,
    tensor_types: dict[str, Q],
    arch: str = "llama",
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 512,
    vocab: int = 64,
    seed: int = 0,
    name: str = "tiny-test",
    head_dim: int | None = None,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """A one-layer llama-shaped GGUF; `tensor_types` maps GGUF base names ("attn_q", "token_embd",
    ...) to their type (F32 when absent). `arch="qwen2"` adds q/k/v biases, `arch="qwen3"` per-head
    q/k norms and an explicit head size; `rope_freqs` is stored as llama.cpp's `rope_freqs.weight`."""
    rng = np.random.default_rng(seed)
    head_dim = head_dim or hidden // heads
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, heads * head_dim),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    if arch == "qwen2":
        shapes |= {
            "blk.0.attn_q.bias": (heads * head_dim,),
            "blk.0.attn_k.bias": (kv_heads * head_dim,),
            "blk.0.attn_v.bias": (kv_heads * head_dim,),
        }
    if arch == "qwen3":
        shapes |= {"blk.0.attn_q_norm.weight": (head_dim,), "blk.0.attn_k_norm.weight": (head_dim,)}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for tensor_name, shape in shapes.items():
        base = tensor_name.removesuffix(".weight").split(".")[-1]
        qtype = tensor_types.get(base, Q.F32)
        w = (
            (1.0 + 0.1 * rng.standard_normal(shape))
            if "norm" in tensor_name
            else 0.1 * rng.standard_normal(shape)
        )
        data = _encode(w.astype(np.float32), qtype, rng)
        writer.add_tensor(tensor_name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
