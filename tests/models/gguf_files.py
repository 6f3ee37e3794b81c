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
) -> Path:
    """A one-layer llama-shaped GGUF; `tensor_types` maps GGUF base names ("attn_q", "token_embd",
    ...) to their type (F32 when absent)."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
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
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny-test")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    for name, shape in shapes.items():
        base = name.removesuffix(".weight").split(".")[-1]
        qtype = tensor_types.get(base, Q.F32)
        w = (1.0 + 0.1 * rng.standard_normal(shape)) if "norm" in name else 0.1 * rng.standard_normal(shape)
        data = _encode(w.astype(np.float32), qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
