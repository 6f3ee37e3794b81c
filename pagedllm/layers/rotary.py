"""Rotary position embedding (neox style: the two halves of each head are rotated as pairs).

One module for every rope type the supported models use: HF's `default`, `linear`, `dynamic` (NTK),
`yarn`, `llama3` and `longrope` (Phi-3's "su"), and llama.cpp's per-frequency divisors (GGUF
`rope_freqs`, how llama.cpp stores llama3 scaling). The cos/sin table for every position is
precomputed once in float32 (exactly as HF derives its per-step cos/sin, attention scaling included)
and indexed by `positions`, so the forward is a gather plus elementwise math: no host syncs, traceable
by torch.compile. One table serves every layer of a model (the models build one `RotaryEmbedding`
per distinct rotation and share it): for a 128k-context model a table per layer would cost gigabytes.
HF's two sequence-length-dependent types are fixed per engine instead (a paged cache keeps keys rotated
once): dynamic NTK raises its base for the longest context served, LongRoPE picks its long or short
factors by whether that context exceeds the pre-training length."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.formats.hf_utils import rope_parameters

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def rope_parameters_from_config(
    hf_config: Any, layer_type: str | None = None
) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from a transformers config of either style (read by
    `pagedllm.formats.hf_utils.rope_parameters`; `layer_type` picks one of a model's per-layer-type
    settings). `rope_scaling` is None for the default rope type."""
    params = rope_parameters(hf_config, layer_type)
    if any(isinstance(value, dict) for value in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported by this model: {params}")
    theta = float(params.pop("rope_theta", None) or 10000.0)
    return (theta, None) if params["rope_type"] == "default" else (theta, params)


def table_length(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """Positions the cos/sin table covers: the context the engine allows the model (the config's
    derived max_model_len, `pagedllm.formats.hf_utils.derived_max_model_len`). Linear, dynamic and YaRN
    configs keep the original length and stretch it by `factor` (YaRN from its
    `original_max_position_embeddings`); llama3 and LongRoPE configs already state the extended one."""
    if scaling is None or scaling["rope_type"] not in ("linear", "dynamic", "yarn"):
        return max_position_embeddings
    factor = float(scaling.get("factor") or 1.0)
    base = max_position_embeddings
    if scaling["rope_type"] == "yarn" and "original_max_position_embeddings" in scaling:
        base = int(scaling["original_max_position_embeddings"])
    return int(base * max(factor, 1.0))


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(
    inv_freq: torch.Tensor, base: float, rotary_dim: int, scaling: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated by `factor`, those turning more than `beta_fast` times kept, a linear ramp between;
    cos/sin are scaled by the attention factor (0.1 ln(factor) + 1 unless given)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


def _longrope(
    exponent: torch.Tensor, base: float, scaling: dict[str, Any], max_positions: int, context_len: int
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 "su"): per-frequency divisors, `long_factor` when the engine's context exceeds
    the pre-training length, `short_factor` otherwise (one set for every position, so cached keys never
    need re-rotating; HF switches per sequence length, which agrees for sequences on the chosen side),
    and cos/sin scaled by sqrt(1 + ln(factor) / ln(original)) unless an attention factor is given."""
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != exponent.numel():
            raise ValueError(
                f"rope_scaling {key} has {len(scaling[key])} entries, not {exponent.numel()} (head size / 2)"
            )
    ext = scaling["long_factor"] if context_len > original else scaling["short_factor"]
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponent), float(attention_factor)


def _inv_freq(
    rotary_dim: int,
    base: float,
    scaling: dict[str, Any] | None,
    max_positions: int = 0,
    context_len: int = 0,
) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos/sin are multiplied by (YaRN and LongRoPE's attention
    scaling; 1 otherwise), each as transformers' `ROPE_INIT_FUNCTIONS` computes them, so the table
    matches HF bit for bit in float32. `max_positions` is the config's `max_position_embeddings`,
    `context_len` the longest sequence the table serves."""
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "dynamic":
        # Dynamic NTK: HF raises the base for the current sequence length; a paged cache needs one
        # rotation per position, so the base is raised once for the longest context served (vLLM's choice).
        factor = float(scaling["factor"])  # type: ignore[index]
        seq_len = max(context_len, table_length(max_positions, scaling))
        base = base * ((factor * seq_len / max_positions) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    if rope_type == "longrope":
        return _longrope(exponent, base, scaling, max_positions, context_len)  # type: ignore[arg-type]
    inv_freq = 1.0 / (base**exponent)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, base, rotary_dim, scaling, max_positions)
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
        max_positions_scaled: bool = False,
    ) -> None:
        """`max_positions_scaled`: `max_position_embeddings` already states the scaled context (Gemma 3
        with linear scaling), so the table is not stretched by the scaling factor."""
        super().__init__()
        self.head_size = head_size
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        self.rope_scaling = rope_scaling
        # llama.cpp-style divisors of the rotary frequencies (see `set_freq_factors`).
        self.freq_factors: torch.Tensor | None = None
        # Rows the model's own context needs, and the longest sequence the engine serves (see
        # `cover_positions`), the model's own by default.
        self.model_len = (
            max_position_embeddings
            if max_positions_scaled
            else table_length(max_position_embeddings, rope_scaling)
        )
        self.context_len = self.model_len
        # Validate the rope type now, not on the first forward.
        _inv_freq(head_size, base, rope_scaling, max_position_embeddings, self.context_len)
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _compute_cache(self) -> torch.Tensor:
        # Always computed on the CPU in float32, whatever device/dtype context the model is built in.
        with torch.device("cpu"):
            inv_freq, attention_factor = _inv_freq(
                self.head_size, self.base, self.rope_scaling, self.max_position_embeddings, self.context_len
            )
            if self.freq_factors is not None:
                inv_freq = inv_freq / self.freq_factors
            length = max(self.model_len, self.context_len)
            t = torch.arange(length, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)
            table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
            return table * attention_factor if attention_factor != 1.0 else table

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
        """Serve sequences of up to `n` tokens (the engine's max_model_len; 0: the model's own maximum).
        The table then holds positions 0..n-1: a max_model_len past the model's maximum (allowed by
        PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN) would otherwise index past its end; the rows beyond continue
        the same frequencies, as HF's rotary embedding computes any position. LongRoPE also chooses
        its factor set by `n`."""
        if n <= 0:
            return
        rows = self.cos_sin_cache.shape[0]
        longrope = self.rope_scaling is not None and self.rope_scaling["rope_type"] == "longrope"
        if n > rows or (longrope and n != self.context_len):
            self.context_len = n
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
    max_positions_scaled: bool = False,
) -> RotaryEmbedding:
    if partial_rotary_factor != 1.0:
        raise ValueError(f"partial_rotary_factor={partial_rotary_factor} is not supported")
    return RotaryEmbedding(head_size, max_position_embeddings, base, rope_scaling, max_positions_scaled)
