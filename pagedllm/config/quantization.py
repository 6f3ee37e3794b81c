"""Quantization methods known to the config: the resolved method object lives in
`EngineConfig.quant_config`. pagedllm implements GGUF block quantization (kept packed and computed
from the blocks; dequantized at load only when the loader is asked to, see `pagedllm.models.loader`)
4-bit AWQ / GPTQ checkpoints (their `quantization_config` read by `maybe_update_config`) and fp8
weights (online from an unquantized checkpoint, or an fp8 checkpoint's with their `weight_scale`); every
other method name is rejected by ModelConfig."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn

    from pagedllm.layers.quant.base import QuantizeMethodBase

# A safetensors checkpoint's tensors from their headers: `{name: (file, shape, dtype)}`.
CheckpointTensors = Mapping[str, tuple[Path, list[int], torch.dtype]]


class QuantizationConfig:
    """Base of a resolved quantization method."""

    name: str = ""

    def get_min_capability(self) -> int:
        """Minimum CUDA capability as an int (e.g. 75 for 7.5)."""
        raise NotImplementedError

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        raise NotImplementedError

    def has_blocked_weights(self) -> bool:
        """Whether weights use block-wise FP8 scales (needs the `quant_fp8` custom op)."""
        return False

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method that creates, loads and applies the weights of `layer` (named `prefix` in the
        model, e.g. "model.layers.0.mlp.down_proj"), or None to leave it unquantized."""
        raise NotImplementedError

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Let the method adjust itself to the checkpoint; methods without such needs keep the base."""

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        """Refuse a checkpoint (`{tensor name: (file, shape, dtype)}`) this method cannot read, naming
        the file and the tensor; methods whose layers check their own tensors keep the base."""

    def compute_hash(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class GGUFQuantizationConfig(QuantizationConfig):
    """llama.cpp block quantization (Q4_0, Q4_1, Q8_0, K-quants...) read from a .gguf file."""

    name = "gguf"

    def get_min_capability(self) -> int:
        return 60

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # Linear layers and the token embedding (with a tied or own LM head) keep the file's blocks;
        # other layers (norms, mixture-of-experts weights) get dequantized tensors from the loader.
        from pagedllm.layers.embedding import VocabParallelEmbedding
        from pagedllm.layers.linear import LinearBase
        from pagedllm.layers.quant.gguf import GGUFLinearMethod, embedding_method

        if isinstance(layer, LinearBase):
            return GGUFLinearMethod()
        if isinstance(layer, VocabParallelEmbedding):
            return embedding_method(layer)
        return None


class Int4QuantizationConfig(QuantizationConfig):
    """4-bit group quantization of the linear layers (AWQ, GPTQ), its parameters read from the
    checkpoint's `quantization_config` (config.json) as vLLM reads them."""

    def __init__(self) -> None:
        self.bits = 4
        self.group_size = 128
        self.desc_act = False
        self.modules_to_not_convert: list[str] = []

    def get_min_capability(self) -> int:
        return 0

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def group_for(self, input_size: int) -> int:
        """The group size of a layer `input_size` wide (-1: one group over the whole input)."""
        return input_size if self.group_size == -1 else self.group_size

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        quant = getattr(hf_config, "quantization_config", None) or {}
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        self.bits = int(quant.get("bits", quant.get("w_bit", 4)))
        self.group_size = int(quant.get("group_size", quant.get("q_group_size", 128)))
        self.desc_act = bool(quant.get("desc_act", False))
        self.modules_to_not_convert = list(quant.get("modules_to_not_convert") or [])
        problem = self._unsupported(quant)
        if self.bits != 4:
            problem = f"bits={self.bits} (only 4-bit is supported)"
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 32):
            problem = f"group_size={self.group_size} (supported: -1 or multiples of 32, e.g. 32/64/128)"
        if problem:
            raise ValueError(f"model {model!r}: {self.name.upper()} checkpoint with {problem}")

    def _unsupported(self, quant: dict[str, Any]) -> str | None:
        """What of this format's `quantization_config` is not supported (None: all of it is)."""
        raise NotImplementedError

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # The linear layers of the decoder; the embedding and the LM head stay float, as AutoAWQ and
        # GPTQModel leave them, and so do the modules the checkpoint lists as not converted.
        from pagedllm.layers.linear import LinearBase
        from pagedllm.layers.quant.int4 import Int4LinearMethod

        if isinstance(layer, LinearBase) and not any(m in prefix for m in self.modules_to_not_convert):
            return Int4LinearMethod(self)
        return None

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        from pagedllm.layers.quant.int4_layouts import checkpoint_problem

        for name in sorted(n for n in tensors if n.endswith(".qweight")):
            problem = checkpoint_problem(self, name.removesuffix(".qweight"), tensors)
            if problem:
                raise ValueError(f"{tensors[name][0]}: {problem}")

    def compute_hash(self) -> str:
        return f"{self.name}-{self.bits}-{self.group_size}-{self.desc_act}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(bits={self.bits}, group_size={self.group_size}, desc_act={self.desc_act})"
        )


class AWQQuantizationConfig(Int4QuantizationConfig):
    """AutoAWQ's GEMM-layout checkpoints (see `pagedllm.layers.quant.int4_layouts`)."""

    name = "awq"

    def _unsupported(self, quant: dict[str, Any]) -> str | None:
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            return f"version={version!r} (only the GEMM layout is supported)"
        if not quant.get("zero_point", True):
            return "zero_point=false (only asymmetric AWQ with zero points is supported)"
        return None


class GPTQQuantizationConfig(Int4QuantizationConfig):
    """AutoGPTQ / GPTQModel checkpoints in the v1 "gptq" format, with or without act-order."""

    name = "gptq"

    def _unsupported(self, quant: dict[str, Any]) -> str | None:
        fmt = str(quant.get("checkpoint_format", "gptq")).lower()
        if fmt != "gptq":
            return f"checkpoint_format={fmt!r} (only the v1 'gptq' format is supported)"
        return None


class Fp8QuantizationConfig(QuantizationConfig):
    """fp8 e4m3 linear layers (`pagedllm.layers.quant.fp8`): online (an unquantized checkpoint's
    weights quantized at load, one scale per output channel), or an fp8 checkpoint's (its config.json
    `quantization_config` says `quant_method: "fp8"`, as vLLM reads it): float8_e4m3fn weights with a
    `weight_scale` per tensor or per output channel. Block-wise scales (`weight_block_size`) are refused."""

    name = "fp8"

    def __init__(self) -> None:
        self.is_checkpoint_fp8_serialized = False
        self.activation_scheme = "dynamic"
        self.ignored_layers: list[str] = []

    def get_min_capability(self) -> int:
        return 0

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def maybe_update_config(self, model: str, hf_config: Any = None, revision: str | None = None) -> None:
        quant = getattr(hf_config, "quantization_config", None)
        if not quant:
            return  # online fp8
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        self.is_checkpoint_fp8_serialized = True
        self.activation_scheme = str(quant.get("activation_scheme", "dynamic"))
        self.ignored_layers = list(quant.get("ignored_layers") or [])
        if quant.get("weight_block_size"):
            raise ValueError(
                f"model {model!r}: block-wise fp8 checkpoints (weight_block_size="
                f"{quant['weight_block_size']}) are not supported; per-tensor and per-channel scales are"
            )
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(
                f"model {model!r}: fp8 activation_scheme={self.activation_scheme!r} is not supported "
                "(supported: 'dynamic', 'static')"
            )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        # The decoder's linear layers; the embedding and the LM head stay in the model dtype, and so
        # do a checkpoint's `ignored_layers` (named as the model names them).
        from pagedllm.layers.linear import LinearBase
        from pagedllm.layers.quant.fp8 import Fp8CheckpointLinearMethod, Fp8OnlineLinearMethod

        if not isinstance(layer, LinearBase) or prefix in self.ignored_layers:
            return None
        if self.is_checkpoint_fp8_serialized:
            return Fp8CheckpointLinearMethod(self.activation_scheme == "static")
        return Fp8OnlineLinearMethod()

    def check_checkpoint(self, tensors: CheckpointTensors) -> None:
        # An fp8 weight is only readable with its scale (`X.weight` -> `X.weight_scale`).
        for name, (path, _, dtype) in sorted(tensors.items()):
            if dtype == torch.float8_e4m3fn and f"{name}_scale" not in tensors:
                raise ValueError(f"{path}: fp8 tensor {name!r} has no {name + '_scale'!r} (its scale)")

    def compute_hash(self) -> str:
        return f"{self.name}-{self.is_checkpoint_fp8_serialized}-{self.activation_scheme}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(checkpoint={self.is_checkpoint_fp8_serialized}, "
            f"activation_scheme={self.activation_scheme!r})"
        )


QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "gguf": GGUFQuantizationConfig,
    "awq": AWQQuantizationConfig,
    "gptq": GPTQQuantizationConfig,
    "fp8": Fp8QuantizationConfig,
}
# The methods a checkpoint's config.json names in `quantization_config.quant_method`.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")
# Those of them that can also quantize an unquantized checkpoint at load.
ONLINE_METHODS = ("fp8",)


def get_quantization_method(name: str) -> QuantizationConfig:
    if name not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization={name!r} is not supported; supported: {', '.join(sorted(QUANTIZATION_METHODS))}"
        )
    return QUANTIZATION_METHODS[name]()
