"""What an HF checkpoint's `quantization_config` (config.json) says, for the formats pagedllm reads.

Read twice: by the configuration, so a checkpoint variant pagedllm cannot run is refused before an engine
starts, and by the loader's quantization methods (`pagedllm.layers.quant.int4`, `.fp8`), which take
their parameters from here. AWQ (AutoAWQ's GEMM layout) and GPTQ (the v1 "gptq" format) are 4-bit group
quantization; fp8 is e4m3 weights with a per-tensor or per-channel `weight_scale`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Int4Params:
    bits: int
    group_size: int
    """-1: one group over a layer's whole input."""
    desc_act: bool
    modules_to_not_convert: list[str]


@dataclass(frozen=True)
class Fp8Params:
    activation_scheme: str
    ignored_layers: list[str]


def checkpoint_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict (None: an unquantized checkpoint)."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    return quant if isinstance(quant, dict) else quant.to_dict()


def _awq_problem(quant: dict[str, Any]) -> str | None:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        return f"version={version!r} (only the GEMM layout is supported)"
    if not quant.get("zero_point", True):
        return "zero_point=false (only asymmetric AWQ with zero points is supported)"
    return None


def _gptq_problem(quant: dict[str, Any]) -> str | None:
    fmt = str(quant.get("checkpoint_format", "gptq")).lower()
    if fmt != "gptq":
        return f"checkpoint_format={fmt!r} (only the v1 'gptq' format is supported)"
    return None


# What of each 4-bit format's `quantization_config` is not supported (None: all of it is).
_INT4_PROBLEMS: dict[str, Callable[[dict[str, Any]], str | None]] = {"awq": _awq_problem, "gptq": _gptq_problem}


def int4_params(model: str, method: str, hf_config: Any) -> Int4Params:
    """AWQ / GPTQ parameters read as vLLM reads them; ValueError naming the variant pagedllm cannot run."""
    quant = checkpoint_quantization(hf_config) or {}
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
    problem = _INT4_PROBLEMS[method](quant)
    if bits != 4:
        problem = f"bits={bits} (only 4-bit is supported)"
    if group_size != -1 and (group_size <= 0 or group_size % 32):
        problem = f"group_size={group_size} (supported: -1 or multiples of 32, e.g. 32/64/128)"
    if problem:
        raise ValueError(f"model {model!r}: {method.upper()} checkpoint with {problem}")
    return Int4Params(
        bits,
        group_size,
        bool(quant.get("desc_act", False)),
        list(quant.get("modules_to_not_convert") or []),
    )


def fp8_params(model: str, hf_config: Any) -> Fp8Params | None:
    """An fp8 checkpoint's parameters (None: an unquantized checkpoint, quantized online at load);
    ValueError for block-wise scales and unknown activation schemes."""
    quant = checkpoint_quantization(hf_config)
    if quant is None:
        return None
    params = Fp8Params(str(quant.get("activation_scheme", "dynamic")), list(quant.get("ignored_layers") or []))
    if quant.get("weight_block_size"):
        raise ValueError(
            f"model {model!r}: block-wise fp8 checkpoints (weight_block_size="
            f"{quant['weight_block_size']}) are not supported; per-tensor and per-channel scales are"
        )
    if params.activation_scheme not in ("dynamic", "static"):
        raise ValueError(
            f"model {model!r}: fp8 activation_scheme={params.activation_scheme!r} is not supported "
            "(supported: 'dynamic', 'static')"
        )
    return params


def check_quant_params(model: str, method: str | None, hf_config: Any) -> None:
    """Refuse a checkpoint whose quantization parameters pagedllm cannot run (GGUF files and
    unquantized checkpoints have none to check)."""
    if method in _INT4_PROBLEMS:
        int4_params(model, method, hf_config)
    elif method == "fp8":
        fp8_params(model, hf_config)
