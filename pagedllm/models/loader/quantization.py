"""Quantization method resolution (the spec's 5.18, run by the loader): the configured method name
(`ModelConfig.quantization`) to its `QuantizationConfig` in `pagedllm.layers.quant`, checked against the
device and the model dtype and updated from the checkpoint's `quantization_config`.

The configuration names the method and checks the checkpoint's parameters early
(`pagedllm.formats.quant_params`); the layers' side is built here, so config never imports layers."""

from __future__ import annotations

from typing import Any

from pagedllm.layers.quant.fp8 import Fp8QuantizationConfig
from pagedllm.layers.quant.gguf import GGUFQuantizationConfig
from pagedllm.layers.quant.int4 import AWQQuantizationConfig, GPTQQuantizationConfig
from pagedllm.platforms import current_platform
from pagedllm.quant_interface import QuantizationConfig

# By the names of `pagedllm.config.quantization.QUANTIZATION_METHODS`.
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "gguf": GGUFQuantizationConfig,
    "awq": AWQQuantizationConfig,
    "gptq": GPTQQuantizationConfig,
    "fp8": Fp8QuantizationConfig,
}


def get_quantization_method(name: str) -> QuantizationConfig:
    if name not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={name!r} is not supported; supported: {', '.join(sorted(QUANTIZATION_METHODS))}"
        )
    return QUANTIZATION_METHODS[name]()


def resolve_quant_config(model_config: Any) -> QuantizationConfig | None:
    """The method `model_config.quantization` names, ready to choose each layer's method (None: an
    unquantized model)."""
    mc = model_config
    if mc.quantization is None:
        return None
    quant = get_quantization_method(mc.quantization)
    cap = current_platform.get_device_capability()
    if cap is not None and cap.to_int() < quant.get_min_capability():
        raise ValueError(
            f"quantization {mc.quantization!r} needs device capability >= {quant.get_min_capability()}, "
            f"this device has {cap.to_int()}"
        )
    if mc.dtype not in quant.get_supported_act_dtypes():
        raise ValueError(
            f"dtype {mc.dtype} is not supported with quantization {mc.quantization!r}; supported: "
            f"{quant.get_supported_act_dtypes()}"
        )
    quant.maybe_update_config(mc.model, hf_config=mc.hf_config, revision=mc.revision)
    return quant
