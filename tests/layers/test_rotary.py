"""Every rope scaling type against transformers' own rotary embedding (`modeling_rope_utils`), at
positions past `original_max_position_embeddings`, and the per-layer-type parameters of Gemma 3."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_from_config

ORIGINAL = 64
HEAD = 32
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "mscale": 0.9,
        "mscale_all_dim": 0.8,
        "beta_fast": 16,
        "truncate": False,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD // 2)],
        "long_factor": [1.0 + 0.5 * i for i in range(HEAD // 2)],
        "original_max_position_embeddings": ORIGINAL,
    },
}


def _config(scaling: dict[str, Any], max_positions: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=2 * HEAD,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_theta": 10000.0, **scaling},
    )


def _hf(config: LlamaConfig, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """HF's rotated q and k ([T, heads * head] each, concatenated) for one sequence of `positions`."""
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    n = positions.shape[0]
    ref_q, ref_k = apply_rotary_pos_emb(
        q.view(1, n, -1, HEAD).transpose(1, 2), k.view(1, n, -1, HEAD).transpose(1, 2), cos, sin
    )
    return torch.cat([ref_q.transpose(1, 2).reshape(n, -1), ref_k.transpose(1, 2).reshape(n, -1)], -1)


def _ours(rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.cat(rope(positions, q, k), -1)


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_matches_hf_past_the_original_context(kind: str) -> None:
    """A whole sequence as long as the table (so HF's sequence-length-dependent types, dynamic NTK and
    LongRoPE, take their long-context branch), compared at every position."""
    max_positions = ORIGINAL if kind in ("linear", "dynamic", "yarn", "yarn-mscale") else 4 * ORIGINAL
    config = _config(SCALINGS[kind], max_positions)
    theta, scaling = rope_parameters_from_config(config)
    rope = get_rope(HEAD, max_positions, theta, scaling)
    length = rope.cos_sin_cache.shape[0]
    assert length == 4 * ORIGINAL or (kind == "llama3" and length == max_positions)
    positions = torch.arange(length)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(length, 2 * HEAD, generator=generator), torch.randn(length, HEAD, generator=generator)
    expected = _hf(config, positions, q, k)
    torch.testing.assert_close(_ours(rope, positions, q, k), expected, atol=2e-5, rtol=0)
    # The scaling changes the rotation past the original context (the test can tell them apart).
    plain = get_rope(HEAD, length, theta, None)
    assert (_ours(plain, positions, q, k) - expected)[ORIGINAL:].abs().max() > 1e-2


def test_longrope_short_factors_for_a_short_context() -> None:
    """An engine whose context fits the pre-training length uses the short factors, as HF does for
    sequences that short; a longer one the long factors at every position."""
    config = _config(SCALINGS["longrope"], 4 * ORIGINAL)
    theta, scaling = rope_parameters_from_config(config)
    rope = get_rope(HEAD, 4 * ORIGINAL, theta, scaling)
    positions = torch.arange(ORIGINAL)
    q, k = torch.randn(ORIGINAL, 2 * HEAD), torch.randn(ORIGINAL, HEAD)
    long_context = _ours(rope, positions, q, k)
    rope.cover_positions(ORIGINAL)
    short_context = _ours(rope, positions, q, k)
    torch.testing.assert_close(short_context, _hf(config, positions, q, k), atol=2e-5, rtol=0)
    assert (short_context - long_context).abs().max() > 1e-2
    assert rope.cos_sin_cache.shape[0] == 4 * ORIGINAL


def test_phi3_original_max_position_embeddings_outside_rope_scaling() -> None:
    class Phi3Style:
        rope_theta = 10000.0
        original_max_position_embeddings = 4096
        rope_scaling = {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}

    _, scaling = rope_parameters_from_config(Phi3Style())
    assert scaling is not None
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 4096


def test_per_layer_type_parameters() -> None:
    config = Gemma3TextConfig(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        }
    )
    assert rope_parameters_from_config(config, "sliding_attention") == (10000.0, None)
    assert rope_parameters_from_config(config, "full_attention") == (
        1000000.0,
        {"rope_type": "linear", "factor": 8.0},
    )
    with pytest.raises(ValueError, match="per-layer-type rope_parameters are not supported"):
        rope_parameters_from_config(config)


def test_longrope_factor_count_must_fit_the_head() -> None:
    scaling = dict(SCALINGS["longrope"], short_factor=[1.0, 1.0])
    with pytest.raises(ValueError, match="short_factor has 2 entries, not 16"):
        get_rope(HEAD, 4 * ORIGINAL, 10000.0, scaling)
