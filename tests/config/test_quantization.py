"""AWQ / GPTQ detected from a checkpoint's `quantization_config` (config.json) as vLLM detects it: the
method fills `quantization`, which the loader resolves (`pagedllm.models.loader.quantization`) with its
group size, act-order and skipped modules read from the checkpoint; a `quantization` flag that contradicts the checkpoint, or names
AWQ/GPTQ for an unquantized one, and the variants pagedllm does not read are clear errors. "fp8" is
either the checkpoint's (e4m3 weights with scales) or, on an unquantized checkpoint, the flag's (online
quantization)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.layers.quant.fp8 import Fp8QuantizationConfig
from pagedllm.layers.quant.int4 import AWQQuantizationConfig, GPTQQuantizationConfig
from pagedllm.models.loader.quantization import resolve_quant_config

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
FP8 = {"quant_method": "fp8", "activation_scheme": "static"}


def _quantized(tiny_llama_dir: Path, tmp_path: Path, quantization_config: dict[str, Any]) -> str:
    """The tiny model's directory with `quantization_config` in its config.json (weights untouched:
    the config alone decides)."""
    out = tmp_path / "quantized"
    shutil.copytree(tiny_llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    ("quantization_config", "cls", "group", "desc_act"),
    [(AWQ, AWQQuantizationConfig, 64, False), (GPTQ, GPTQQuantizationConfig, 32, True)],
)
@pytest.mark.parametrize("flag", [False, True])
def test_method_is_detected_from_config_json(
    tiny_llama_dir: Path,
    tmp_path: Path,
    quantization_config: dict,
    cls: type,
    group: int,
    desc_act: bool,
    flag: bool,
) -> None:
    model = _quantized(
        tiny_llama_dir, tmp_path, {**quantization_config, "modules_to_not_convert": ["o_proj"]}
    )
    method = quantization_config["quant_method"]
    cfg = EngineConfig(model_config=ModelConfig(model=model, quantization=method if flag else None))
    assert cfg.model_config.quantization == method
    quant = resolve_quant_config(cfg.model_config)
    assert isinstance(quant, cls) and quant.name == method
    assert (quant.bits, quant.group_size, quant.desc_act) == (4, group, desc_act)
    assert quant.modules_to_not_convert == ["o_proj"]


def test_flag_conflicting_with_the_checkpoint_is_an_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = _quantized(tiny_llama_dir, tmp_path, AWQ)
    with pytest.raises(ValueError, match=r"quantization='gptq' conflicts with model .* quant_method='awq'"):
        ModelConfig(model=model, quantization="gptq")


def test_fp8_flag_quantizes_an_unquantized_checkpoint_online(tiny_llama_dir: Path) -> None:
    cfg = EngineConfig(model_config=ModelConfig(model=str(tiny_llama_dir), quantization="fp8"))
    assert cfg.model_config.quantization == "fp8" and isinstance(resolve_quant_config(cfg.model_config), Fp8QuantizationConfig)


@pytest.mark.parametrize("flag", [None, "fp8"])
def test_fp8_checkpoint_is_detected_from_config_json(
    tiny_llama_dir: Path, tmp_path: Path, flag: str | None
) -> None:
    cfg = EngineConfig(
        model_config=ModelConfig(model=_quantized(tiny_llama_dir, tmp_path, FP8), quantization=flag)
    )
    quant = resolve_quant_config(cfg.model_config)
    assert cfg.model_config.quantization == "fp8" and isinstance(quant, Fp8QuantizationConfig)
    assert quant.is_checkpoint_fp8_serialized and quant.activation_scheme == "static"


def test_flag_conflicting_with_an_fp8_checkpoint_is_an_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = _quantized(tiny_llama_dir, tmp_path, FP8)
    with pytest.raises(ValueError, match=r"quantization='gptq' conflicts with model .* quant_method='fp8'"):
        ModelConfig(model=model, quantization="gptq")


def test_flag_on_an_unquantized_checkpoint_is_an_error(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' but model .* has no quantization_config"):
        ModelConfig(model=str(tiny_llama_dir), quantization="awq")


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        ({**AWQ, "bits": 8}, "bits=8"),
        ({**AWQ, "version": "gemv"}, "version='gemv'"),
        ({**AWQ, "zero_point": False}, "zero_point=false"),
        ({**GPTQ, "checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
        ({**GPTQ, "group_size": 48}, "group_size=48"),
        ({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes', which is not supported"),
        (
            {**FP8, "weight_block_size": [128, 128]},
            r"block-wise fp8 checkpoints \(weight_block_size=\[128, 128\]\)",
        ),
        ({**FP8, "activation_scheme": "tensor"}, "activation_scheme='tensor'"),
        (
            {"quant_method": "compressed-tensors"},
            "quantized with 'compressed-tensors', which is not supported",
        ),
    ],
)
def test_unsupported_variants_are_refused(
    tiny_llama_dir: Path, tmp_path: Path, quantization_config: dict, message: str
) -> None:
    model = _quantized(tiny_llama_dir, tmp_path, quantization_config)
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_config=ModelConfig(model=model))


def test_other_method_on_a_gguf_file_is_an_error(smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization='awq' conflicts with GGUF file"):
        ModelConfig(model=str(smollm2_gguf), quantization="awq")
