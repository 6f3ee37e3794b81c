"""Unsupported features are rejected at construction with an error naming the flag; bad input
errors name the field."""

from __future__ import annotations

import re

import pytest
from config_testing import build_cuda

import pagedllm.config as config_pkg
from pagedllm.config import (
    AttentionConfig,
    AuxOutputConfig,
    CacheConfig,
    CompilationConfig,
    DiffusionConfig,
    ECTransferConfig,
    EngineConfig,
    EngramConfig,
    KernelConfig,
    KVEventsConfig,
    KVTransferConfig,
    LoadConfig,
    LoggingConfig,
    LoRAConfig,
    MambaConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    ProfilerConfig,
    ReasoningConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    WeightTransferConfig,
)
from pagedllm.config.support import allow_unsupported, check_in_process, check_supported, unsupported_features


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"lora_config": LoRAConfig(fully_sharded_loras=True)}, "fully_sharded_loras"),
        (
            {"speculative_config": SpeculativeConfig(method="mtp", num_speculative_tokens=2)},
            "speculative_config.method='mtp'",
        ),
        (
            {"speculative_config": SpeculativeConfig(method="draft_model", num_speculative_tokens=2)},
            "speculative_config.method='draft_model' without speculative_config.model",
        ),
        (
            {"speculative_config": SpeculativeConfig(method="eagle", num_speculative_tokens=2)},
            "speculative_config.method='eagle' without speculative_config.model",
        ),
        (
            {"kv_transfer_config": KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")},
            "kv_connector",
        ),
        (
            {"kv_transfer_config": KVTransferConfig(kv_connector="P2pNcclConnector", kv_role="kv_both")},
            "P2pNcclConnector",
        ),
        (
            {"kv_transfer_config": KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")},
            "LMCacheConnectorV1",
        ),
        (
            {"cache_config": CacheConfig(kv_offloading_size=2, kv_offloading_backend="lmcache")},
            "kv_offloading_backend='lmcache'",
        ),
        (
            {"kv_transfer_config": KVTransferConfig(kv_connector="SharedStorageConnector")},
            "kv_transfer_config.kv_role",
        ),
        (
            {
                "cache_config": CacheConfig(cache_dtype="fp8", calculate_kv_scales=True),
                "kv_transfer_config": KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both"),
            },
            "calculate_kv_scales with SharedStorageConnector",
        ),
        ({"diffusion_config": DiffusionConfig(canvas_length=8)}, "diffusion_config"),
        ({"engram_config": EngramConfig()}, "engram"),
        ({"reasoning_config": ReasoningConfig()}, "reasoning_config"),
        (
            {"parallel_config": ParallelConfig(data_parallel_size=2, distributed_executor_backend="ray")},
            "data parallelism with distributed_executor_backend='ray'",
        ),
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


# Options that only mean something to a feature pagedllm lacks: any value but the default is refused.
@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"parallel_config": ParallelConfig(dcp_comm_backend="a2a")}, "dcp_comm_backend"),
        ({"parallel_config": ParallelConfig(all2all_backend="naive")}, "all2all_backend"),
        ({"parallel_config": ParallelConfig(enable_fault_tolerance=True)}, "enable_fault_tolerance"),
        ({"cache_config": CacheConfig(mamba_cache_mode="all")}, "mamba_cache_mode"),
        ({"cache_config": CacheConfig(replayssm_buffer_len=16)}, "replayssm_buffer_len"),
        ({"cache_config": CacheConfig(kv_offloading_backend="lmcache")}, "kv_offloading_backend"),
        ({"scheduler_config": SchedulerConfig(disable_chunked_mm_input=True)}, "disable_chunked_mm_input"),
        (
            {"structured_outputs_config": StructuredOutputsConfig(backend="lm-format-enforcer")},
            "lm-format-enforcer",
        ),
        (
            {"reasoning_config": ReasoningConfig(reasoning_parser="qwen3", think_end_str="</answer>")},
            "reasoning_config.think_end_str",
        ),
        ({"profiler_config": ProfilerConfig(profiler="torch")}, "profiler_config.profiler"),
        ({"profiler_config": ProfilerConfig(torch_profiler_dir="/tmp/p")}, "torch_profiler_dir"),
        ({"mamba_config": MambaConfig(backend="flashinfer")}, "mamba_config.backend"),
        ({"attention_config": AttentionConfig(backend="triton_paged")}, "triton_paged"),
        ({"kernel_config": KernelConfig(ir_op_priority={"rms_norm": ["aiter"]})}, "aiter"),
        ({"load_config": LoadConfig(model_loader_extra_config={"x": 1})}, "model_loader_extra_config"),
        (
            {"observability_config": ObservabilityConfig(show_hidden_metrics_for_version="0.1")},
            "show_hidden_metrics_for_version",
        ),
    ],
)
def test_option_of_missing_feature_rejected(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"does not support: .*{re.escape(flag)}"):
        EngineConfig(model_config=ModelConfig(), **fields)


def test_supported_values_of_the_same_options_pass() -> None:
    cfg = EngineConfig(
        model_config=ModelConfig(),
        attention_config=AttentionConfig(backend="torch_paged"),
        kernel_config=KernelConfig(ir_op_priority={"rms_norm": ["native"]}),
        kv_events_config=KVEventsConfig(),
        parallel_config=ParallelConfig(distributed_executor_backend="uni"),
        structured_outputs_config=StructuredOutputsConfig(
            backend="guidance",
            disable_fallback=True,
            disable_any_whitespace=True,
            disable_additional_properties=True,
            reasoning_parser="deepseek_r1",
        ),
        reasoning_config=ReasoningConfig(reasoning_parser="qwen3"),
        scheduler_config=SchedulerConfig(stream_interval=4),
        logging_config=LoggingConfig(enable_log_requests=True, max_log_len=10),
        observability_config=ObservabilityConfig(
            otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces", collect_detailed_traces=["all"]
        ),
        cache_config=CacheConfig(kv_offloading_size=2),
    )
    assert unsupported_features(cfg) == []
    assert cfg.kv_transfer_config is not None and cfg.kv_transfer_config.kv_connector == "OffloadingConnector"
    for connector in ("SharedStorageConnector", "OffloadingConnector"):
        kv = KVTransferConfig(kv_connector=connector, kv_role="kv_consumer")
        assert unsupported_features(EngineConfig(model_config=ModelConfig(), kv_transfer_config=kv)) == []
    multi = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "SharedStorageConnector"}]},
    )
    assert unsupported_features(EngineConfig(model_config=ModelConfig(), kv_transfer_config=multi)) == []
    # The target's compiled forward returns the hidden states an EAGLE-3 head reads.
    eagle3 = SpeculativeConfig(method="eagle3", model="head", num_speculative_tokens=2)
    compiled = CompilationConfig(mode=3)
    assert unsupported_features(
        EngineConfig(model_config=ModelConfig(), speculative_config=eagle3, compilation_config=compiled)
    ) == []
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        cache = CacheConfig(cache_dtype=dtype, calculate_kv_scales=True)
        assert unsupported_features(EngineConfig(model_config=ModelConfig(), cache_config=cache)) == []


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        # Each of these trips its own consistency rule first (HiSparse needs CUDA, DBO a DeepEP
        # backend, engram an engram model, aux outputs a V2 runner, an encoder producer a multimodal
        # model, proton CUDA): the error must still say the feature is unsupported.
        ({"attention_config": AttentionConfig(hisparse_config={})}, "hisparse_config"),
        ({"parallel_config": ParallelConfig(enable_dbo=True)}, "enable_dbo"),
        ({"engram_config": EngramConfig()}, "engram_config"),
        ({"aux_output_config": AuxOutputConfig(return_routed_experts=True)}, "return_routed_experts"),
        ({"ec_transfer_config": ECTransferConfig(ec_role="ec_producer")}, "ec_transfer_config"),
        ({"profiler_config": ProfilerConfig(profiler="proton")}, "profiler_config.profiler"),
    ],
)
def test_unsupported_named_before_its_own_consistency_error(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"does not support: .*{re.escape(flag)}") as info:
        EngineConfig(model_config=ModelConfig(), **fields)
    assert "Construction also reported" in str(info.value)


def test_consistency_errors_kept_when_gate_lifted_or_nothing_unsupported() -> None:
    with allow_unsupported(), pytest.raises(ValueError, match="HiSparse needs CUDA"):
        EngineConfig(model_config=ModelConfig(), attention_config=AttentionConfig(hisparse_config={}))
    with pytest.raises(ValueError, match="needs speculative decoding") as info:
        EngineConfig(
            model_config=ModelConfig(),
            observability_config=ObservabilityConfig(per_request_spec_decode_metrics="summary"),
        )
    assert "does not support" not in str(info.value)


def test_scheduler_runner_follows_the_model() -> None:
    cfg = EngineConfig(model_config=ModelConfig(), scheduler_config=SchedulerConfig(runner_type="pooling"))
    assert cfg.scheduler_config.runner_type == "generate"
    with pytest.raises(ValueError, match="scheduler_config.runner_type='draft'"):
        EngineConfig(model_config=None, scheduler_config=SchedulerConfig(runner_type="draft"))


def test_unsupported_model_features() -> None:
    with pytest.raises(ValueError, match="model_config.runner='draft'"):
        EngineConfig(model_config=ModelConfig(runner="draft"))
    with pytest.raises(ValueError, match="convert='classify' is not supported"):
        EngineConfig(model_config=ModelConfig(convert="classify"))
    with pytest.raises(ValueError, match="model_config.sleep_mode_offload_cudagraph"):
        EngineConfig(model_config=ModelConfig(enable_sleep_mode=True, sleep_mode_offload_cudagraph=True))


def test_operations_supported() -> None:
    # Sleep mode, weight updates over NCCL/gloo and the torch profiler are implemented (issue 24).
    cfg = EngineConfig(
        model_config=ModelConfig(enable_sleep_mode=True),
        weight_transfer_config=WeightTransferConfig(backend="nccl", extra={"timeout_s": 60}),
        profiler_config=ProfilerConfig(profiler="torch", torch_profiler_dir="/tmp/p"),
    )
    assert unsupported_features(cfg) == []


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"weight_transfer_config": WeightTransferConfig(extra={"chunk": 1})}, "extra keys ['chunk']"),
    ],
)
def test_weight_transfer_options_rejected(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=f"does not support: .*{re.escape(flag)}"):
        EngineConfig(model_config=ModelConfig(), **fields)


def test_every_unsupported_flag_listed_once(triton_installed: None) -> None:
    with allow_unsupported():
        cfg = EngineConfig(
            model_config=ModelConfig(),
            lora_config=LoRAConfig(fully_sharded_loras=True),
            diffusion_config=DiffusionConfig(canvas_length=8),
        )
    found = unsupported_features(cfg)
    assert any("lora_config" in f for f in found) and any("diffusion_config" in f for f in found)
    with pytest.raises(ValueError, match="lora_config.*diffusion_config"):
        check_supported(cfg)


def test_default_config_is_supported() -> None:
    assert unsupported_features(EngineConfig(model_config=ModelConfig())) == []
    assert unsupported_features(build_cuda()) == []


def test_gate_lifted_only_inside_block() -> None:
    with allow_unsupported():
        EngineConfig(lora_config=LoRAConfig(fully_sharded_loras=True))
    with pytest.raises(ValueError, match="fully_sharded_loras"):
        EngineConfig(lora_config=LoRAConfig(fully_sharded_loras=True))


# -- bad input names the field -------------------------------------------------------------------------
def test_unknown_field() -> None:
    with pytest.raises(ValueError, match="max_num_seq\n"):
        SchedulerConfig(max_num_seq=4)
    with pytest.raises(ValueError, match="blocksize"):
        EngineConfig(blocksize=16)


SUB_CONFIGS = [
    getattr(config_pkg, name)
    for name in config_pkg.__all__
    if hasattr(getattr(config_pkg, name), "__pydantic_fields__")
]


@pytest.mark.parametrize("cls", SUB_CONFIGS, ids=[c.__name__ for c in SUB_CONFIGS])
def test_every_config_class_forbids_unknown_fields(cls: type) -> None:
    with pytest.raises(ValueError, match=r"no_such_field\n.*Unexpected keyword argument"):
        cls(no_such_field=1)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: CacheConfig(block_size="big"), "block_size"),
        (lambda: SchedulerConfig(max_num_seqs="many"), "max_num_seqs"),
        (lambda: ParallelConfig(tensor_parallel_size=1.5), "tensor_parallel_size"),
        (lambda: ModelConfig(enforce_eager="maybe"), "enforce_eager"),
        (lambda: CompilationConfig(cudagraph_capture_sizes="1,2"), "cudagraph_capture_sizes"),
        (lambda: EngineConfig(shutdown_timeout="soon"), "shutdown_timeout"),
        (lambda: EngineConfig(cache_config={"block_size": -1}), "cache_config.block_size"),
    ],
)
def test_wrong_type_names_the_field(build, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        build()


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


@pytest.mark.parametrize(
    "fields, flag",
    [
        ({"lora_config": LoRAConfig()}, "lora_config with tensor or pipeline parallelism"),
        (
            {"speculative_config": SpeculativeConfig(method="ngram", num_speculative_tokens=2)},
            "speculative_config with tensor or pipeline parallelism",
        ),
        ({"cache_config": CacheConfig(kv_offloading_size=1)}, "kv_offloading_size with tensor or pipeline"),
    ],
)
def test_single_rank_features_rejected_with_parallelism(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=re.escape(flag)):
        EngineConfig(model_config=ModelConfig(), parallel_config=ParallelConfig(pipeline_parallel_size=2), **fields)
    with allow_unsupported():
        EngineConfig(model_config=ModelConfig(), **fields)  # one rank: the same feature builds


def test_data_parallelism_is_served_not_run_offline() -> None:
    internal = EngineConfig(model_config=ModelConfig(), parallel_config=ParallelConfig(data_parallel_size=2))
    with pytest.raises(ValueError, match="not supported offline.*pagedllm serve --data-parallel-size 2"):
        check_in_process(internal)
    # One rank behind an external load balancer is one engine core: the offline engine runs it.
    rank = ParallelConfig(data_parallel_size=2, data_parallel_index=1, data_parallel_external_lb=True)
    check_in_process(EngineConfig(model_config=ModelConfig(), parallel_config=rank))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data_parallel_size": 2, "data_parallel_index": 2, "data_parallel_external_lb": True}, "below"),
        ({"data_parallel_size": 2, "data_parallel_index": 1}, "--data-parallel-external-lb"),
    ],
)
def test_data_parallel_rank_checked(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_the_gates_name_lists_match_what_is_implemented() -> None:
    # config/ names what the packages above it implement (it may not import them): the lists must agree.
    from pagedllm.config.kv_transfer import KV_CONNECTORS
    from pagedllm.config.speculative import IMPLEMENTED_METHODS
    from pagedllm.config.support import MOE_ARCHITECTURES
    from pagedllm.distributed.kv_transfer import registered_connectors
    from pagedllm.models.registry import supported_architectures
    from pagedllm.spec_decode.proposers import PROPOSERS

    assert sorted(KV_CONNECTORS) == sorted(registered_connectors())
    assert MOE_ARCHITECTURES <= set(supported_architectures())
    assert sorted(IMPLEMENTED_METHODS) == sorted(PROPOSERS)
