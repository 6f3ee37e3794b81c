"""Quantization in the configuration: the method names.

pagedllm runs GGUF block quantization (kept packed and computed from the blocks; dequantized at load
only when the loader is asked to, see `pagedllm.models.loader`), 4-bit AWQ / GPTQ checkpoints and fp8
weights (online from an unquantized checkpoint, or an fp8 checkpoint's with their `weight_scale`); every
other method name is rejected by ModelConfig. Each method's `QuantizationConfig` (the interface in
`pagedllm.quant_interface`) lives beside its linear method in `pagedllm.layers.quant.<format>`; the loader
resolves the configured name to it (`pagedllm.models.loader.quantization`), so the configuration never
imports layers. Construction checks the checkpoint's parameters early (`pagedllm.formats.quant_params`)."""

from __future__ import annotations

# The methods pagedllm runs, each a `QuantizationConfig` in `pagedllm.layers.quant.<format>` that the loader
# (`pagedllm.models.loader.quantization`) resolves by this name.
QUANTIZATION_METHODS = ("gguf", "awq", "gptq", "fp8")
# The methods a checkpoint's config.json names in `quantization_config.quant_method`.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
# Those of them that can also quantize an unquantized checkpoint at load.
ONLINE_METHODS = ("fp8",)
