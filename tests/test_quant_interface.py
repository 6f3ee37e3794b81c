"""Every quantization method the loader resolves implements the interface the configuration holds
and the layers call."""

from __future__ import annotations

from pagedllm.layers.quant import LinearMethodBase, QuantizeMethodBase
from pagedllm.models.loader.quantization import QUANTIZATION_METHODS
from pagedllm.quant_interface import QuantizationConfig


def test_every_method_implements_the_interface() -> None:
    assert len(QUANTIZATION_METHODS) >= 4
    for name, cls in QUANTIZATION_METHODS.items():
        assert issubclass(cls, QuantizationConfig)
        assert cls.name == name
        for member in ("get_quant_method", "get_min_capability", "get_supported_act_dtypes"):
            assert getattr(cls, member) is not getattr(QuantizationConfig, member), (name, member)


def test_linear_methods_are_quantize_methods() -> None:
    assert issubclass(LinearMethodBase, QuantizeMethodBase)
