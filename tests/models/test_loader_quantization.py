"""Quantization method resolution by the loader: every method name the configuration accepts has its
`QuantizationConfig` in the layers, an unquantized model has none, and the device and dtype checks of
the spec's 5.18 refuse what a method cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from pagedllm.config import ModelConfig
from pagedllm.config.quantization import QUANTIZATION_METHODS
from pagedllm.layers.quant.gguf import GGUFQuantizationConfig
from pagedllm.models.loader.quantization import QUANTIZATION_METHODS as RESOLVED
from pagedllm.models.loader.quantization import get_quantization_method, resolve_quant_config
from pagedllm.platforms import override_platform


def test_every_configured_name_resolves() -> None:
    assert tuple(RESOLVED) == QUANTIZATION_METHODS
    assert all(get_quantization_method(name).name == name for name in QUANTIZATION_METHODS)
    with pytest.raises(ValueError, match="quantization='bitsandbytes' is not supported; supported: awq, fp8"):
        get_quantization_method("bitsandbytes")


def test_resolves_the_model_configs_method(tmp_path: Path) -> None:
    assert isinstance(resolve_quant_config(ModelConfig()), GGUFQuantizationConfig)  # the embedded GGUF
    LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    assert resolve_quant_config(ModelConfig(model=str(tmp_path))) is None


def test_device_and_dtype_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    mc = ModelConfig()
    with override_platform("cuda", capability=(5, 0)):
        with pytest.raises(ValueError, match="quantization 'gguf' needs device capability >= 60, this device has 50"):
            resolve_quant_config(mc)
    monkeypatch.setattr(GGUFQuantizationConfig, "get_supported_act_dtypes", lambda self: [torch.float16])
    with pytest.raises(ValueError, match="is not supported with quantization 'gguf'"):
        resolve_quant_config(mc)
