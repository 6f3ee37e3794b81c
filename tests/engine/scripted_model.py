"""Shared by the front-end tests that run without a model: the scripted reply and the slice of
ModelConfig the front-end reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pagedllm.config import (
    CacheConfig,
    LoggingConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)

# Every scripted request's output, one token per step.
SCRIPT = " one two three four five six seven eight nine ten"


@dataclass
class FakeModelConfig:
    max_model_len: int = 128
    max_logprobs: int = 20
    eos_token_ids: list[int] = field(default_factory=lambda: [2])

    def get_vocab_size(self) -> int:
        return 49152

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return {}


def fake_engine_config(**sub_configs: Any) -> Any:
    """The sub-configs a front-end reads, at their defaults unless given."""
    defaults: dict[str, Any] = {
        "model_config": FakeModelConfig(),
        "structured_outputs_config": StructuredOutputsConfig(),
        "scheduler_config": SchedulerConfig(),
        "cache_config": CacheConfig(),
        "logging_config": LoggingConfig(),
        "observability_config": ObservabilityConfig(),
        "parallel_config": ParallelConfig(),
        # No watermark, speculation or adapters here.
        "watermark_config": None,
        "speculative_config": None,
        "lora_config": None,
    }
    return SimpleNamespace(**{**defaults, **sub_configs})
