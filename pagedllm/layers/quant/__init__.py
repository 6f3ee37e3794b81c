"""Quantization methods of layers (see `base`); the configs that choose them live in
`pagedllm.config.quantization`."""

from pagedllm.layers.quant.base import LinearMethodBase, QuantizeMethodBase, WeightLoader, set_weight_loader

__all__ = ["LinearMethodBase", "QuantizeMethodBase", "WeightLoader", "set_weight_loader"]
