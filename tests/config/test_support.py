"""Unsupported features are rejected at construction with an error naming the flag; bad input
errors name the field."""

from __future__ import annotations

import pytest
from config_testing import build_cuda

from pagedllm.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    DiffusionConfig,
    EngineConfig,
    EngramConfig,
    KVTransferConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    ReasoningConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    WatermarkConfig,
)
from pagedllm.config.support import allow_unsupported, check_supported, unsupported_features


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"lora_config": LoRAConfig()}, "lora_config"),
        (
            {"speculative_config": SpeculativeConfig(method="eagle", num_speculative_tokens=2)},
            "speculative_config",
        ),
        (
            {"kv_transfer_config": KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")},
            "kv_connector",
        ),
        ({"cache_config": CacheConfig(kv_offloading_size=2)}, "kv_offloading_size"),
        ({"cache_config": CacheConfig(cache_dtype="fp8")}, "cache_dtype"),
        ({"diffusion_config": DiffusionConfig(canvas_length=8)}, "diffusion_config"),
        ({"engram_config": EngramConfig()}, "engram"),
        ({"watermark_config": WatermarkConfig()}, "watermark_config"),
        ({"reasoning_config": ReasoningConfig()}, "reasoning_config"),
        ({"parallel_config": ParallelConfig(pipeline_parallel_size=2)}, "pipeline_parallel_size"),
        ({"parallel_config": ParallelConfig(data_parallel_size=2)}, "data_parallel_size"),
        (
            {"parallel_config": ParallelConfig(enable_dbo=True, all2all_backend="deepep_low_latency")},
            "enable_dbo",
        ),
        (
            {"structured_outputs_config": StructuredOutputsConfig(backend="outlines")},
            "structured_outputs_config.backend",
        ),
        ({"load_config": LoadConfig(load_format="bitsandbytes")}, "load_format"),
        ({"attention_config": AttentionConfig(hisparse_config={})}, "hisparse"),
        ({"compilation_config": CompilationConfig(pass_config={"fuse_norm_quant": True})}, "fuse_norm_quant"),
        ({"scheduler_config": SchedulerConfig(scheduler_cls="my.Scheduler")}, "scheduler_cls"),
    ],
)
def test_unsupported_feature_rejected(fields: dict, flag: str) -> None:
    # Some fail an earlier consistency check of their own (engram without engram layers, HiSparse
    # off CUDA); either way the message names the feature.
    with pytest.raises(ValueError, match=f"(?i){flag}"):
        EngineConfig(model_config=ModelConfig(), **fields)


def test_unsupported_model_features() -> None:
    with pytest.raises(ValueError, match="model_config.pooler_config"):
        EngineConfig(model_config=ModelConfig(pooler_config={}))
    with pytest.raises(ValueError, match="model_config.enable_sleep_mode"):
        EngineConfig(model_config=ModelConfig(enable_sleep_mode=True))


def test_every_unsupported_flag_listed_once(triton_installed: None) -> None:
    with allow_unsupported():
        cfg = EngineConfig(
            model_config=ModelConfig(),
            lora_config=LoRAConfig(),
            watermark_config=WatermarkConfig(),
        )
    found = unsupported_features(cfg)
    assert any("lora_config" in f for f in found) and any("watermark_config" in f for f in found)
    with pytest.raises(ValueError, match="lora_config.*watermark_config"):
        check_supported(cfg)


def test_default_config_is_supported() -> None:
    assert unsupported_features(EngineConfig(model_config=ModelConfig())) == []
    assert unsupported_features(build_cuda()) == []


def test_gate_lifted_only_inside_block() -> None:
    with allow_unsupported():
        EngineConfig(lora_config=LoRAConfig())
    with pytest.raises(ValueError, match="lora_config"):
        EngineConfig(lora_config=LoRAConfig())


# -- bad input names the field -------------------------------------------------------------------------
def test_unknown_field() -> None:
    with pytest.raises(ValueError, match="max_num_seq\n"):
        SchedulerConfig(max_num_seq=4)
    with pytest.raises(ValueError, match="blocksize"):
        EngineConfig(blocksize=16)


def test_negative_shutdown_timeout() -> None:
    with pytest.raises(ValueError, match="shutdown_timeout"):
        EngineConfig(shutdown_timeout=-1)


def test_bad_enum_values() -> None:
    with pytest.raises(ValueError, match="performance_mode"):
        EngineConfig(performance_mode="fast")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CompilationConfig(cudagraph_mode="SOMETIMES")
    with pytest.raises(ValueError, match="optimization_level"):
        EngineConfig(optimization_level=7)


def test_bad_numbers_name_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=0)


def test_inconsistent_capture_sizes() -> None:
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        build_cuda(compilation={"cudagraph_capture_sizes": [1, 2, 8], "max_cudagraph_capture_size": 4})


def test_chunked_prefill_off_needs_budget(tiny_llama_dir) -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(100\).*max_model_len \(512\)"):
        EngineConfig(
            model_config=ModelConfig(model=str(tiny_llama_dir)),
            scheduler_config=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=100),
        )
    cfg = EngineConfig(
        model_config=ModelConfig(model=str(tiny_llama_dir)),
        scheduler_config=SchedulerConfig(enable_chunked_prefill=False),
    )
    assert cfg.scheduler_config.max_model_len == 512


def test_spec_metrics_need_spec() -> None:
    from pagedllm.config import ObservabilityConfig

    with pytest.raises(ValueError, match="per_request_spec_decode_metrics"):
        EngineConfig(
            model_config=ModelConfig(),
            observability_config=ObservabilityConfig(per_request_spec_decode_metrics="summary"),
        )


def test_after_validators_run() -> None:
    with allow_unsupported():
        with pytest.raises(
            ValueError, match="mamba_block_size can only be set together with enable_prefix_caching"
        ):
            EngineConfig(
                model_config=ModelConfig(),
                cache_config=CacheConfig(mamba_block_size=16, enable_prefix_caching=False),
            )
        with pytest.raises(ValueError, match="does not support ReplaySSM"):
            EngineConfig(model_config=ModelConfig(), cache_config=CacheConfig(use_replayssm=True))
        cfg = EngineConfig(model_config=ModelConfig(), cache_config=CacheConfig(use_kda_recoverssm=True))
    assert cfg.cache_config.use_kda_recoverssm is False
