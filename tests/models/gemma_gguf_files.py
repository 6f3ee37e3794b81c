"""Test helper: small Gemma 2 / Gemma 3 GGUF files in llama.cpp's layout (its tensor names, norm weights
stored plus one, no output projection: tied embeddings), random weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, RopeScalingType
from gguf.quants import quantize


def write_gemma_gguf(
    path: Path,
    arch: str,
    layers: int,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    ffn: int = 128,
    vocab: int = 96,
    window: int = 8,
    seed: int = 0,
    quantized: tuple[str, ...] = ("attn_q", "ffn_up"),
) -> Path:
    """`arch` "gemma2" (soft caps) or "gemma3" (q/k norms, linear scaling of the global layers);
    the projections named in `quantized` are stored as Q8_0."""
    rng = np.random.default_rng(seed)
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
    }
    for i in range(layers):
        block = {
            "attn_norm": (hidden,),
            "attn_q": (heads * head_dim, hidden),
            "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden),
            "attn_output": (hidden, heads * head_dim),
            "post_attention_norm": (hidden,),
            "ffn_norm": (hidden,),
            "ffn_gate": (ffn, hidden),
            "ffn_up": (ffn, hidden),
            "ffn_down": (hidden, ffn),
            "post_ffw_norm": (hidden,),
        }
        if arch == "gemma3":
            block |= {"attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,)}
        shapes |= {f"blk.{i}.{name}.weight": shape for name, shape in block.items()}
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(window)
    writer.add_vocab_size(vocab)
    if arch == "gemma2":
        writer.add_rope_freq_base(10000.0)
        writer.add_attn_logit_softcapping(2.0)
        writer.add_final_logit_softcapping(3.0)
    else:
        writer.add_rope_freq_base(1000000.0)
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    for name, shape in shapes.items():
        base = name.removesuffix(".weight").split(".")[-1]
        # llama.cpp stores Gemma's `1 + weight` norms with the one added.
        w = (1.0 + 0.1 * rng.standard_normal(shape)) if "norm" in name else 0.15 * rng.standard_normal(shape)
        w = w.astype(np.float32)
        if base in quantized:
            writer.add_tensor(name, quantize(w, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(name, w)
    return finish_gguf(writer, path)


def finish_gguf(writer: GGUFWriter, path: Path) -> Path:
    """Write out and close `writer`'s file at `path`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
