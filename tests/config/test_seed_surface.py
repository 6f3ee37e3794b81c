"""Every public name the seed document (vllm.config.vllm) documents exists in pagedllm, under
pagedllm's names (VllmConfig -> EngineConfig, *_vllm_config -> *_config)."""

from __future__ import annotations

import dataclasses
import inspect
import time
import typing

import pytest

import pagedllm.config as config_pkg
from pagedllm.config import EngineConfig, OptimizationLevel

# Seed name -> pagedllm name, where they differ.
RENAMED = {
    "VllmConfig": "EngineConfig",
    "set_current_vllm_config": "set_current_config",
    "get_layers_from_vllm_config": "get_layers_from_config",
}

MODULE_FUNCTIONS = [
    "set_current_vllm_config",
    "get_cached_compilation_config",
    "get_layers_from_vllm_config",
    "default_breakable_cudagraph_architectures",
    "enable_act_fusion",
    "enable_allreduce_rms_fusion",
    "enable_mla_dual_rms_norm_fusion",
    "enable_norm_fusion",
    "enable_norm_pad_fusion",
    "enable_qk_norm_rope_kvcache",
    "enable_rope_kvcache_fusion",
    "enable_rope_kvcache_mla_fusion",
]
CLASSES = ["VllmConfig", "OptimizationLevel"]
METHODS = [
    "compute_hash",
    "with_hf_config",
    "compile_debug_dump_path",
    "enable_trace_function_call_for_thread",
    "validate_block_size",
    "adjust_dcp_kv_cache_interleave_size",
    "try_verify_and_update_config",
    # Not get_quantization_config: the loader resolves the method (pagedllm.models.loader.quantization),
    # so the configuration does not import the layers that implement it.
    "validate_nvfp4_kv_cache_with_mla",
    "validate_mamba_block_size",
    "validate_mamba_cached_kernel",
    "__str__",
]
PROPERTIES = [
    "is_mm_encoder_only",
    "max_concurrent_batches",
    "max_in_flight_tokens",
    "num_speculative_tokens",
    "num_lookahead_tokens",
    "num_prefill_lookahead_tokens",
    "uniform_decode_query_len",
    "use_cumem_cudagraph_pool",
    "use_v2_model_runner",
    "needs_dp_coordinator",
]
FIELDS = [
    "model_config",
    "cache_config",
    "parallel_config",
    "scheduler_config",
    "device_config",
    "load_config",
    "offload_config",
    "attention_config",
    "aux_output_config",
    "engram_config",
    "mamba_config",
    "kernel_config",
    "lora_config",
    "speculative_config",
    "watermark_config",
    "diffusion_config",
    "structured_outputs_config",
    "observability_config",
    "logging_config",
    "quant_config",
    "compilation_config",
    "profiler_config",
    "kv_transfer_config",
    "kv_events_config",
    "ec_transfer_config",
    "ec_manager_config",
    "reasoning_config",
    "additional_config",
    "instance_id",
    "optimization_level",
    "performance_mode",
    "weight_transfer_config",
    "shutdown_timeout",
]
ISSUE_CLASSES = (
    "EngineConfig OptimizationLevel ModelConfig CacheConfig ParallelConfig SchedulerConfig DeviceConfig LoadConfig "
    "OffloadConfig AttentionConfig CompilationConfig CompilationMode CUDAGraphMode PassConfig KernelConfig LoRAConfig "
    "SpeculativeConfig StructuredOutputsConfig ObservabilityConfig LoggingConfig ProfilerConfig KVTransferConfig "
    "KVEventsConfig ECTransferConfig EncoderCacheManagerConfig ReasoningConfig WatermarkConfig MambaConfig "
    "DiffusionConfig EngramConfig AuxOutputConfig WeightTransferConfig QuantizationConfig"
).split()


@pytest.mark.parametrize("name", MODULE_FUNCTIONS + CLASSES)
def test_module_names(name: str) -> None:
    assert callable(getattr(config_pkg, RENAMED.get(name, name)))


@pytest.mark.parametrize("name", METHODS)
def test_methods(name: str) -> None:
    assert callable(getattr(EngineConfig, name))


@pytest.mark.parametrize("name", PROPERTIES)
def test_properties(name: str) -> None:
    assert isinstance(inspect.getattr_static(EngineConfig, name), property)


def test_fields_in_order() -> None:
    assert [f.name for f in dataclasses.fields(EngineConfig)] == FIELDS


def test_issue_classes_importable() -> None:
    missing = [name for name in ISSUE_CLASSES if not hasattr(config_pkg, name)]
    assert missing == []


def test_optimization_levels() -> None:
    assert [(m.name, int(m)) for m in OptimizationLevel] == [("O0", 0), ("O1", 1), ("O2", 2), ("O3", 3)]
    assert EngineConfig().optimization_level == OptimizationLevel.O2


def test_every_field_has_a_docstring() -> None:
    undocumented = []
    for name in ISSUE_CLASSES:
        cls = getattr(config_pkg, name)
        fields = getattr(cls, "__pydantic_fields__", None)
        if fields is None:
            continue
        undocumented += [f"{name}.{field}" for field, info in fields.items() if not info.description]
    assert undocumented == []


# Spec section 2: default of every top-level field ("factory" = a fresh default sub-config).
FACTORY_FIELDS = {
    "cache_config",
    "parallel_config",
    "scheduler_config",
    "device_config",
    "load_config",
    "offload_config",
    "attention_config",
    "aux_output_config",
    "mamba_config",
    "kernel_config",
    "structured_outputs_config",
    "observability_config",
    "logging_config",
    "compilation_config",
    "profiler_config",
    "ec_manager_config",
}
NONE_FIELDS = {
    "model_config",
    "engram_config",
    "lora_config",
    "speculative_config",
    "watermark_config",
    "diffusion_config",
    "quant_config",
    "kv_transfer_config",
    "kv_events_config",
    "ec_transfer_config",
    "reasoning_config",
    "weight_transfer_config",
}


FACTORY_CLASS = {
    "aux_output_config": "AuxOutputConfig",
    "ec_manager_config": "EncoderCacheManagerConfig",
    "structured_outputs_config": "StructuredOutputsConfig",
}


def _camel(field: str) -> str:
    return "".join(part.capitalize() for part in field.split("_"))


def test_top_level_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert FACTORY_FIELDS | NONE_FIELDS | {
        "additional_config",
        "instance_id",
        "optimization_level",
        "performance_mode",
        "shutdown_timeout",
    } == set(fields)
    info = EngineConfig.__pydantic_fields__
    for name in NONE_FIELDS:
        assert info[name].default is None, name
    for name in FACTORY_FIELDS:
        factory = info[name].default_factory
        assert factory is not None, name
        # cache_config -> CacheConfig, ec_manager_config -> EncoderCacheManagerConfig, ...
        assert type(factory()).__name__ == FACTORY_CLASS.get(name, _camel(name)), name
    assert info["additional_config"].default_factory() == {}
    assert (info["instance_id"].default, info["optimization_level"].default) == ("", OptimizationLevel.O2)
    assert (info["performance_mode"].default, info["shutdown_timeout"].default) == ("balanced", 0)
    assert typing.get_args(info["performance_mode"].annotation) == ("balanced", "interactivity", "throughput")
    a, b = EngineConfig(), EngineConfig()
    # Each instance gets its own sub-configs: construction mutates them.
    assert a.compilation_config is not b.compilation_config and a.cache_config is not b.cache_config


def test_instance_id_is_always_the_construction_time() -> None:
    before = time.time_ns()
    cfg = EngineConfig(instance_id="mine")
    assert cfg.instance_id.isdigit() and before <= int(cfg.instance_id) <= time.time_ns()
