"""Rotary position embedding (neox style: the two halves of each head are rotated as pairs).

Supports HF's `default`, `linear` and `llama3` rope types, and llama.cpp's per-frequency divisors
(GGUF `rope_freqs`, how llama.cpp stores llama3 scaling). The cos/sin table for every position is
precomputed once in float32 (exactly as HF derives its per-step cos/sin) and indexed by `positions`,
so the forward is a gather plus elementwise math: no host syncs, traceable by torch.compile. One
table serves every layer of a model (the models build one `RotaryEmbedding` and share it): for a
128k-context model a table per layer would cost gigabytes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_from_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from a transformers config of either style.

    transformers >= 5 keeps everything in `rope_parameters` (with `rope_theta` inside); older configs
    have top-level `rope_theta` and `rope_scaling`. `rope_scaling` is None for the default rope type.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and "rope_type" not in params:
            # Per-layer-type parameters (e.g. {"full_attention": {...}}): not used by our models.
            raise ValueError(f"per-layer-type rope_parameters are not supported: {params}")
        theta = float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", None) or 10000.0)
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def table_length(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """Positions the cos/sin table covers. Linear scaling stretches the context: HF configs keep the
    original `max_position_embeddings` and the engine allows `factor` times that (the config's derived
    max_model_len), so the table must too. llama3 configs already state the extended length."""
    if scaling is not None and scaling["rope_type"] == "linear":
        return int(max_position_embeddings * max(float(scaling["factor"]), 1.0))
    return max_position_embeddings


def _inv_freq(rotary_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # Same expression as transformers' rope init, so the table matches HF bit for bit in float32.
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponent)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are interpolated by `factor`, short ones kept, the middle band blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.rope_scaling = rope_scaling
        # llama.cpp-style divisors of the rotary frequencies (see `set_freq_factors`).
        self.freq_factors: torch.Tensor | None = None
        # Positions the table covers past the model's own maximum (see `cover_positions`).
        self.min_positions = 0
        # Validate the rope type now, not on the first forward.
        _inv_freq(head_size, base, rope_scaling)
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _compute_cache(self) -> torch.Tensor:
        # Always computed on the CPU in float32, whatever device/dtype context the model is built in.
        with torch.device("cpu"):
            inv_freq = _inv_freq(self.head_size, self.base, self.rope_scaling)
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors
            length = max(table_length(self.max_position_embeddings, self.rope_scaling), self.min_positions)
            t = torch.arange(length, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def set_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide each rotary frequency by `factors[i]` ([head_size // 2]), as llama.cpp applies a GGUF's
        `rope_freqs` tensor: its converter stores llama3 scaling that way instead of in the metadata."""
        if tuple(factors.shape) != (self.head_size // 2,):
            raise ValueError(
                f"rope frequency factors of shape {tuple(factors.shape)} do not fit head size {self.head_size}"
            )
        self.freq_factors = factors.detach().to("cpu", torch.float32).clone()
        self.init_buffers()

    def cover_positions(self, n: int) -> None:
        """Make the table hold positions 0..n-1: an engine `max_model_len` past the model's maximum
        (allowed by PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN) would otherwise index past its end. The rows
        beyond continue the same frequencies, as HF's rotary embedding computes any position."""
        if n > self.cos_sin_cache.shape[0]:
            self.min_positions = n
            self.init_buffers()

    def init_buffers(self) -> None:
        """Recompute the table after the module was built on the meta device and moved with
        `to_empty` (which leaves buffers uninitialized)."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = self._compute_cache().to(device)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        x = x.view(num_tokens, -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return out.view(num_tokens, -1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query` [T, num_heads * head_size] and `key` [T, num_kv_heads * head_size]."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_pos={self.max_position_embeddings}, base={self.base}"


def get_rope(
    head_size: int,
    max_position_embeddings: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    partial_rotary_factor: float = 1.0,
) -> RotaryEmbedding:
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} is not supported")
    return RotaryEmbedding(head_size, max_position_embeddings, base, rope_scaling)
