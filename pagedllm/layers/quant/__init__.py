"""Quantization methods of layers (see `base`). Each format's module holds its `QuantizationConfig`
(the interface in `pagedllm.config.quantization`) beside the linear method it chooses: `gguf`, `int4`
(AWQ, GPTQ), `fp8`; the loader resolves the configured method name to it."""

from pagedllm.layers.quant.base import (
    LinearMethodBase,
    QuantGraphKey,
    QuantizeMethodBase,
    WeightLoader,
    set_weight_loader,
)

__all__ = ["LinearMethodBase", "QuantGraphKey", "QuantizeMethodBase", "WeightLoader", "set_weight_loader"]
