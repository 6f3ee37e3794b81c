"""fp8 KV cache elements: a layer's keys (values) are stored as `x / k_scale` (`x / v_scale`) in one
byte, saturated to the format's largest finite value, and read back as `fp8 * scale`.

Each attention layer holds its two scales in a float32 tensor `[k_scale, v_scale]` (1.0 unless
`calculate_kv_scales` sets them from the first prompt step). They are a tensor, not constants: the
compiled decoder block and the attention impl are shared by every layer of the same shape.
"""

from __future__ import annotations

import torch

# `cache_dtype` names of the fp8 formats ("fp8" is e4m3, as in vLLM).
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x / scale` in the fp8 `dtype`, rounded to nearest even and saturated (torch's own
    conversion turns values past the largest finite one into NaN / inf)."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache elements `x` as `dtype` values: `x * scale` for an fp8 cache, `x` itself otherwise."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def scales_from(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[k_scale, v_scale]` that map the largest magnitude of `key` / `value` to the fp8 maximum
    (a tensor of zeros gets scale 1.0)."""
    amax = torch.stack([key.abs().amax().float(), value.abs().amax().float()])
    return torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))
