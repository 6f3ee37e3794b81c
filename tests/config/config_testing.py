"""Shared builder for config tests (imported by name: tests/ directories are not packages)."""

from __future__ import annotations

from typing import Any

from pagedllm.config import CompilationConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.config.support import allow_unsupported
from pagedllm.platforms import override_platform


def build_cuda(
    seqs: int = 256,
    tokens: int = 8192,
    *,
    capability: tuple[int, int] = (9, 0),
    compilation: dict[str, Any] | None = None,
    eager: bool = False,
    model: str | None = None,
    **fields: Any,
) -> EngineConfig:
    """An EngineConfig built as on a CUDA GPU of `capability`, with the support gate lifted so the
    spec's algorithms can be checked for features pagedllm does not run (speculative decoding)."""
    with override_platform("cuda", capability=capability), allow_unsupported():
        model_config = (
            ModelConfig(enforce_eager=eager)
            if model is None
            else ModelConfig(model=model, enforce_eager=eager)
        )
        return EngineConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=tokens),
            compilation_config=CompilationConfig(**(compilation or {})),
            **fields,
        )


def write_hf_dir(path: Any, **overrides: Any) -> str:
    """Save a tiny Llama config.json (no weights) with `overrides` and return the directory."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    fields.update(overrides)
    LlamaConfig(**fields).save_pretrained(path)
    return str(path)
