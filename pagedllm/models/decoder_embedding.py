"""Decoder bodies saved without an LM head (HF `Qwen3Model`, `Qwen2Model`, `LlamaModel` checkpoints,
e.g. Qwen3-Embedding's shape), for the pooling runner: their tensors carry no `model.` prefix, so the
body itself is the loaded module. A `*ForCausalLM` checkpoint run with `runner="pooling"` (or
`convert="embed"`) uses its own class; the engine's pooler (last token by default) reads the final
hidden states either way."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.llama import LlamaModel as LlamaBody
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from pagedllm.quant_interface import QuantizationConfig


class _DecoderBody(LlamaBody):
    # The causal LM whose attention options and weight folding the body shares.
    causal_lm: ClassVar[type[LlamaForCausalLM]] = LlamaForCausalLM
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    skip_weight_substrs = LlamaForCausalLM.skip_weight_substrs

    def __init__(self, config: Any, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, "model", self.causal_lm.attention_options(config), quant_config)
        self.config = config

    def decoder_layers(self) -> Sequence[nn.Module]:
        return self.layers


class LlamaModel(_DecoderBody):
    causal_lm = LlamaForCausalLM


class Qwen2Model(_DecoderBody):
    causal_lm = Qwen2ForCausalLM


class Qwen3Model(_DecoderBody):
    causal_lm = Qwen3ForCausalLM
