"""pagedllm: high-throughput, memory-efficient LLM inference and serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Lazy exports: `import pagedllm.config` must not pay for torch/transformers start-up.
_EXPORTS = {
    "LLM": "pagedllm.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "RequestOutputKind": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.structured_output.params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "EngineConfig": "pagedllm.config",
    "EngineArgs": "pagedllm.config.args",
}

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.config.args import EngineArgs
    from pagedllm.llm import LLM
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams
    from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "EngineArgs",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
