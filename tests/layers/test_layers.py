"""Layers vs their transformers counterparts (norm, rotary incl. llama3/linear scaling, activation)
and the merged linears' shard loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.layers import bf16_gemm
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import LogitsProcessor, ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, linear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import get_rope, rope_parameters_from_config


def test_rmsnorm_matches_hf_and_fuses_residual() -> None:
    torch.manual_seed(0)
    ours, ref = RMSNorm(64, eps=1e-5), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=0)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref(x + residual), atol=1e-6, rtol=0)


def test_silu_and_mul() -> None:
    x = torch.randn(5, 16)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(x[:, :8]) * x[:, 8:])


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_matches_hf(kind: str) -> None:
    config = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        rope_theta=50000.0,
        rope_scaling=ROPES[kind],
    )
    theta, scaling = rope_parameters_from_config(config)
    assert theta == 50000.0 and (scaling is None) == (kind == "default")
    rope = get_rope(64, 512, theta, scaling)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511])
    q, k = torch.randn(7, 2 * 64), torch.randn(7, 64)
    got_q, got_k = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, 7, 2, 64).transpose(1, 2), k.view(1, 7, 1, 64).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(got_q, ref_q.transpose(1, 2).reshape(7, -1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, ref_k.transpose(1, 2).reshape(7, -1), atol=1e-5, rtol=0)


def _hf_rope(config: LlamaConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """HF's rotated q and k, flattened to our [T, heads * head] layout and concatenated."""
    heads, kv_heads, head = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, -1, heads, head).transpose(1, 2), k.view(1, -1, kv_heads, head).transpose(1, 2), cos, sin
    )
    n = positions.shape[0]
    return torch.cat([ref_q.transpose(1, 2).reshape(n, -1), ref_k.transpose(1, 2).reshape(n, -1)], -1)


def test_linear_rope_table_covers_the_stretched_context() -> None:
    # The engine allows max_position_embeddings x factor tokens with linear scaling.
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=100,
        rope_scaling={"rope_type": "linear", "factor": 3.0},
    )
    theta, scaling = rope_parameters_from_config(config)
    rope = get_rope(64, 100, theta, scaling)
    assert rope.cos_sin_cache.shape[0] == 300
    assert get_rope(64, 100, theta, None).cos_sin_cache.shape[0] == 100
    positions = torch.tensor([0, 99, 100, 250, 299])
    q, k = torch.randn(5, 64), torch.randn(5, 64)
    got = torch.cat(rope(positions, q, k), -1)
    torch.testing.assert_close(got, _hf_rope(config, positions, q, k), atol=1e-5, rtol=0)


def test_freq_factors_reproduce_llama3_scaling() -> None:
    """Dividing the default frequencies by llama.cpp's `rope_freqs` table (here derived from HF's own
    default and llama3 inverse frequencies) gives HF's llama3 rotation."""
    shape = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    llama3 = LlamaConfig(**shape, rope_theta=50000.0, rope_scaling=ROPES["llama3"])
    default = LlamaConfig(**shape, rope_theta=50000.0)
    factors = LlamaRotaryEmbedding(default).inv_freq / LlamaRotaryEmbedding(llama3).inv_freq
    assert (factors > 1.5).any()
    rope = get_rope(64, 512, 50000.0, None)
    rope.set_freq_factors(factors)
    positions = torch.tensor([0, 1, 17, 63, 64, 300, 511])
    q, k = torch.randn(7, 2 * 64), torch.randn(7, 64)
    got = torch.cat(rope(positions, q, k), -1)
    torch.testing.assert_close(got, _hf_rope(llama3, positions, q, k), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="do not fit head size 64"):
        rope.set_freq_factors(torch.ones(5))


def test_rope_parameters_old_style_config() -> None:
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_parameters_from_config(Old()) == (
        1234.0,
        {"factor": 2.0, "rope_type": "linear"},
    )


def test_unsupported_rope_type() -> None:
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not supported"):
        get_rope(64, 128, 10000.0, {"rope_type": "mrope", "factor": 2.0})


def test_qkv_and_gate_up_shard_loading() -> None:
    qkv = QKVParallelLinear(16, head_size=4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    qb, kb, vb = torch.randn(16), torch.randn(8), torch.randn(8)
    for shard, w, b in (("k", k, kb), ("v", v, vb), ("q", q, qb)):
        qkv.weight_loader(qkv.weight, w, shard)
        qkv.weight_loader(qkv.bias, b, shard)
    x = torch.randn(3, 16)
    torch.testing.assert_close(
        qkv(x), torch.cat([F.linear(x, q, qb), F.linear(x, k, kb), F.linear(x, v, vb)], -1)
    )
    with pytest.raises(ValueError, match="does not match"):
        qkv.weight_loader(qkv.weight, torch.randn(9, 16), "k")

    gate_up = MergedColumnParallelLinear(16, [32, 32])
    g, u = torch.randn(32, 16), torch.randn(32, 16)
    gate_up.weight_loader(gate_up.weight, u, 1)
    gate_up.weight_loader(gate_up.weight, g, 0)
    torch.testing.assert_close(gate_up(x), torch.cat([F.linear(x, g), F.linear(x, u)], -1))

    down = RowParallelLinear(32, 16)
    d = torch.randn(16, 32)
    down.weight_loader(down.weight, d)
    torch.testing.assert_close(down(torch.ones(2, 32)), F.linear(torch.ones(2, 32), d))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "column slice", "transposed"])
def test_single_row_linear_compiled_matches_eager(dtype: torch.dtype, layout: str) -> None:
    """The one-row path (a multiply-reduce with its input row stored first) inside a compiled graph,
    fed by a pointwise producer (an RMSNorm) and by strided views, against `F.linear`."""
    torch.manual_seed(0)
    norm = RMSNorm(32).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    weight, bias = torch.randn(48, 32, dtype=dtype), torch.randn(48, dtype=dtype)
    wide = torch.randn(3, 64, dtype=dtype)
    row = {
        "contiguous": wide[1:2, :32],
        "column slice": wide[1:2, 16:48],
        "transposed": wide.t().contiguous()[:32, 1:2].t(),
    }[layout]

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear(norm(x), weight, bias), linear(x, weight)

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    got, got_plain = compiled(row)
    want, want_plain = fn(row)
    # bf16 outputs (|y| up to ~20) may differ from eager by the last bit: 0.125 at that size.
    tol = {"atol": 0.15, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_plain, want_plain, **tol)


def test_embedding_and_lm_head_logits_float32() -> None:
    embed = VocabParallelEmbedding(50, 8).to(torch.bfloat16)
    head = ParallelLMHead(50, 8)
    head.tie_weights(embed)
    with torch.no_grad():
        embed.weight.normal_()
    ids = torch.tensor([3, 7, 49])
    hidden = embed(ids)
    torch.testing.assert_close(hidden, embed.weight[ids])
    logits = LogitsProcessor()(head, hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, 50)
    if bf16_gemm.available():
        # The batch-invariant kernel's logits are the float32 products, never rounded to bfloat16.
        torch.testing.assert_close(logits, hidden.float() @ embed.weight.float().T)
    else:
        torch.testing.assert_close(logits, (hidden @ embed.weight.T).float())
