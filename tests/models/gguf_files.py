"""Test helper: write small GGUF files with chosen tensor types (llama.cpp layout) via `gguf`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

# Byte layout of one 256-element super-block: (size, offsets of its float16 scale fields, largest
# scale: Q6_K's random int8 sub-block scales reach 128, so its super-block scale is kept 10x smaller
# to give weights of the others' magnitude).
_K_QUANTS = {
    Q.Q2_K: (84, (80, 82), 1e-3),
    Q.Q3_K: (110, (108,), 1e-3),
    Q.Q4_K: (144, (0, 2), 1e-3),
    Q.Q5_K: (176, (0, 2), 1e-3),
    Q.Q6_K: (210, (208,), 1e-4),
}


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype in _K_QUANTS:
        # gguf can only dequantize K-quants: write random blocks with small finite scales instead.
        size, scale_offsets, largest = _K_QUANTS[qtype]
        blocks = rng.integers(0, 256, size=(w.size // 256, size), dtype=np.uint8)
        for off in scale_offsets:
            scales = rng.uniform(largest / 10, largest, size=blocks.shape[0]).astype(np.float16)
            blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(w.shape[0], -1)
    try:
        return quantize(w, qtype)
    except NotImplementedError:  # a type gguf cannot quantize (I-quants): random bytes of its size
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        return rng.integers(0, 256, size=(w.shape[0], w.shape[1] // block_elems * block_bytes), dtype=np.uint8)


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


def _permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation for "llama" files (HF half-split rotary layout to
    its interleaved one)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf_from_hf(
    hf: Any, path: Path, arch: str, name: str = "tiny-moe", tensor_types: dict[str, Q] | None = None
) -> Path:
    """Convert an in-memory transformers mixture-of-experts model (Qwen2-MoE, Qwen3-MoE, or Mixtral
    as arch "llama") to GGUF as llama.cpp's converter lays it out: experts stacked per projection
    (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`), the router as `ffn_gate_inp`, Qwen2-MoE's shared
    expert as `ffn_*_shexp`, and q/k rows permuted for "llama". `tensor_types` as in `write_llama_gguf`."""
    config = hf.config
    types = tensor_types or {}
    rng = np.random.default_rng(0)
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch != "llama":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    hf_block = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    }
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for gguf_base, hf_name in hf_block.items():
            for suffix in ("weight", "bias"):
                w = state.get(f"{prefix}{hf_name}.{suffix}")
                if w is None:
                    continue
                if arch == "llama" and gguf_base in ("attn_q", "attn_k"):
                    w = _permute_rows(w, heads if gguf_base == "attn_q" else kv_heads)
                tensors[f"blk.{i}.{gguf_base}.{suffix}"] = w.reshape(-1) if gguf_base == "ffn_gate_inp_shexp" else w
        gate_up = state.get(f"{prefix}mlp.experts.gate_up_proj")
        if gate_up is not None:
            inter = gate_up.shape[1] // 2
            tensors[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :inter]
            tensors[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, inter:]
            tensors[f"blk.{i}.ffn_down_exps.weight"] = state[f"{prefix}mlp.experts.down_proj"]
    for tensor_name, w in tensors.items():
        qtype = types.get(tensor_name.removesuffix(".weight").split(".")[-1], Q.F32)
        data = _encode(np.ascontiguousarray(w, dtype=np.float32), qtype, rng)
        writer.add_tensor(tensor_name, data, raw_dtype=None if qtype == Q.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
