"""Architecture name (HF `config.architectures`) -> model class."""

from __future__ import annotations

import importlib

from torch import nn

from pagedllm.errors import ModelLoadError

# Imported lazily, so asking for one architecture does not import every model file.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("pagedllm.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("pagedllm.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("pagedllm.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("pagedllm.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("pagedllm.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("pagedllm.models.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("pagedllm.models.phi3", "Phi3ForCausalLM"),
    "Olmo2ForCausalLM": ("pagedllm.models.olmo2", "Olmo2ForCausalLM"),
    "GraniteForCausalLM": ("pagedllm.models.granite", "GraniteForCausalLM"),
    "BertModel": ("pagedllm.models.bert", "BertModel"),
    "BertForSequenceClassification": ("pagedllm.models.bert", "BertForSequenceClassification"),
    "LlamaModel": ("pagedllm.models.decoder_embedding", "LlamaModel"),
    "Qwen2Model": ("pagedllm.models.decoder_embedding", "Qwen2Model"),
    "Qwen3Model": ("pagedllm.models.decoder_embedding", "Qwen3Model"),
    "MixtralForCausalLM": ("pagedllm.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("pagedllm.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("pagedllm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in `architectures`."""
    for arch in architectures or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ModelLoadError(
        f"model architecture {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )
