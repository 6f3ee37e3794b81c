"""Spec 6.2-6.7 and 6.10: compilation/graph mode defaults, compile ranges, speculative properties,
async scheduling, the hybrid KV cache manager and KV offloading, as exact values."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from config_testing import build_cuda, write_hf_dir

from pagedllm.config import (
    CacheConfig,
    CompilationMode,
    CUDAGraphMode,
    DiffusionConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    OptimizationLevel,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagedllm.config import parallel as parallel_module
from pagedllm.config.graph_sizes import set_compile_ranges
from pagedllm.config.support import allow_unsupported
from pagedllm.platforms import override_platform

G512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


@pytest.fixture
def async_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's examples assume an executor that supports async scheduling."""
    monkeypatch.setitem(parallel_module.EXECUTOR_SUPPORTS_ASYNC, "uni", True)
    monkeypatch.setitem(parallel_module.EXECUTOR_SUPPORTS_ASYNC, "mp", True)


def spec(method: str, k: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_speculative_tokens=k, **kw)


# -- 6.2 compilation and graph mode defaults ----------------------------------------------------------
@pytest.mark.parametrize(
    ("level", "mode", "graph_mode", "op", "wrap"),
    [
        (0, CompilationMode.NONE, CUDAGraphMode.NONE, "all", False),
        (1, CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE, "none", True),
        (2, CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE, "none", True),
        (3, CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE, "none", True),
    ],
)
def test_m1_to_m4_levels(level, mode, graph_mode, op, wrap, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(optimization_level=level)
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode, cc.custom_ops, cc.ir_enable_torch_wrap) == (
        mode,
        graph_mode,
        [op],
        wrap,
    )
    assert cfg.kernel_config.enable_flashinfer_autotune is (level > 0)
    assert "Inductor compilation was disabled" not in caplog.text
    if level == 0:
        assert (cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes) == (0, [])
    else:
        assert cc.cudagraph_capture_sizes == G512


def test_m5_enforce_eager() -> None:
    cfg = build_cuda(eager=True)
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode, cc.custom_ops, cc.ir_enable_torch_wrap) == (
        CompilationMode.NONE,
        CUDAGraphMode.NONE,
        ["all"],
        False,
    )
    assert cfg.kernel_config.enable_jit_warmup is False
    assert (cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes) == (0, [])


def test_m5_fault_tolerance_keeps_jit_warmup() -> None:
    cfg = build_cuda(eager=True, parallel_config=ParallelConfig(enable_fault_tolerance=True))
    assert cfg.kernel_config.enable_jit_warmup is True


@pytest.mark.parametrize("via_env", [False, True])
def test_m6_user_mode_none(via_env: bool, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    if via_env:
        monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with caplog.at_level(logging.INFO, logger="pagedllm.config"):
        cfg = build_cuda(compilation=None if via_env else {"mode": 0})
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode, cc.custom_ops, cc.ir_enable_torch_wrap) == (
        CompilationMode.NONE,
        CUDAGraphMode.FULL_DECODE_ONLY,
        ["all"],
        False,
    )
    assert cc.cudagraph_capture_sizes == G512
    assert "Inductor compilation was disabled" in caplog.text
    assert "overriding to FULL_DECODE_ONLY" in caplog.text


def test_m7_o1_user_mode_none() -> None:
    cc = build_cuda(optimization_level=1, compilation={"mode": "NONE"}).compilation_config
    assert (cc.mode, cc.cudagraph_mode, cc.max_cudagraph_capture_size, cc.cudagraph_capture_sizes) == (
        CompilationMode.NONE,
        CUDAGraphMode.NONE,
        0,
        [],
    )


def test_m8_pooling_model(async_executor: None) -> None:
    with override_platform("cuda", capability=(9, 0)), allow_unsupported():
        cfg = EngineConfig(model_config=ModelConfig(pooler_config={}))
    cc = cfg.compilation_config
    assert (cc.mode, cc.cudagraph_mode, cc.custom_ops) == (
        CompilationMode.VLLM_COMPILE,
        CUDAGraphMode.PIECEWISE,
        ["none"],
    )
    assert cfg.scheduler_config.async_scheduling is False


def test_m9_user_custom_ops() -> None:
    cc = build_cuda(compilation={"custom_ops": ["none", "+rms_norm"]}).compilation_config
    assert cc.custom_ops == ["none", "+rms_norm"]
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.is_custom_op_enabled("rms_norm") and not cc.is_custom_op_enabled("silu_and_mul")


class _BlockFP8(QuantizationConfig):
    name = "fp8"
    weight_block_size = [128, 128]

    def get_min_capability(self) -> int:
        return 89

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16]


def test_m10_block_quantized_appends_quant_fp8() -> None:
    cc = build_cuda(quant_config=_BlockFP8()).compilation_config
    assert cc.custom_ops == ["+quant_fp8", "none", "+quant_fp8"]
    assert cc.mode == CompilationMode.VLLM_COMPILE


# -- 6.3 compile ranges --------------------------------------------------------------------------------
def test_r1_no_fusions() -> None:
    assert build_cuda().compilation_config.compile_ranges_endpoints == [8192]


def test_r2_user_endpoints() -> None:
    cfg = build_cuda(compilation={"compile_ranges_endpoints": [1, 16, 512, 8192, 10000]})
    assert cfg.compilation_config.compile_ranges_endpoints == [16, 512, 8192]


def test_r3_invalid_endpoint() -> None:
    # pydantic reports an assertion inside construction as a ValidationError (a ValueError) whose
    # message starts "Assertion failed"; the spec's AssertionError cases surface that way.
    with pytest.raises(ValueError, match="Assertion failed, Invalid compile range endpoint 0"):
        build_cuda(compilation={"compile_ranges_endpoints": [0]})


@pytest.mark.parametrize(("max_mb", "expected"), [(2, [256, 8192]), (64, [8192])])
def test_r4_r5_allreduce_fusion(tmp_path: Path, max_mb: int, expected: list[int]) -> None:
    model = write_hf_dir(tmp_path, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    cfg = build_cuda(
        model=model,
        compilation={
            "pass_config": {"fuse_allreduce_rms": True, "fi_allreduce_fusion_max_size_mb": {1: max_mb}},
        },
    )
    assert cfg.model_config.dtype == torch.bfloat16
    assert cfg.compilation_config.compile_ranges_endpoints == expected


def test_r6_rope_fusions_keep_duplicates() -> None:
    cfg = build_cuda(
        compilation={
            "pass_config": {
                "fuse_rope_kvcache": True,
                "fuse_qk_norm_rope_kvcache": True,
                "rope_kvcache_fusion_max_token_num": 256,
            }
        }
    )
    assert cfg.compilation_config.compile_ranges_endpoints == [256, 256, 8192]


def test_r7_no_budget() -> None:
    cfg = build_cuda()
    cfg.scheduler_config.max_num_batched_tokens = None
    set_compile_ranges(cfg)
    assert cfg.compilation_config.compile_ranges_endpoints == []


# -- 6.4 speculative properties ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "speculative", "diffusion", "k", "q", "lookahead", "prefill"),
    [
        ("S1", None, None, 0, 1, 0, 0),
        ("S2", spec("eagle", 3), None, 3, 4, 3, 1),
        ("S2b", spec("eagle3", 3), None, 3, 4, 3, 1),
        ("S3", spec("mtp", 3, mtp_num_modules=3), None, 3, 4, 3, 3),
        ("S4", spec("draft_model", 4), None, 4, 5, 4, 0),
        ("S5", spec("ngram", 5), None, 5, 6, 0, 0),
        ("S5b", spec("ngram_gpu", 5), None, 5, 6, 0, 0),
        ("S6", spec("dflash", 4), None, 4, 5, 5, 1),
        ("S7", None, DiffusionConfig(canvas_length=16), 16, 17, 0, 0),
    ],
)
def test_speculative_properties(name, speculative, diffusion, k, q, lookahead, prefill) -> None:
    cfg = build_cuda(speculative_config=speculative, diffusion_config=diffusion)
    assert (
        cfg.num_speculative_tokens,
        cfg.uniform_decode_query_len,
        cfg.num_lookahead_tokens,
        cfg.num_prefill_lookahead_tokens,
    ) == (k, q, lookahead, prefill), name


def test_max_num_scheduled_tokens(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        assert (
            build_cuda(
                tokens=8192, speculative_config=spec("eagle", 3)
            ).scheduler_config.max_num_scheduled_tokens
            == 8192
        )
    assert "suboptimal" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        assert (
            build_cuda(
                tokens=4096, speculative_config=spec("eagle", 3)
            ).scheduler_config.max_num_scheduled_tokens
            == 4096
        )
    assert "suboptimal" in caplog.text
    assert build_cuda(tokens=8192).scheduler_config.max_num_scheduled_tokens is None


def test_max_num_scheduled_tokens_errors() -> None:
    with override_platform("cuda", capability=(9, 0)), allow_unsupported():
        with pytest.raises(ValueError, match="max_num_scheduled_tokens"):
            EngineConfig(
                model_config=ModelConfig(),
                scheduler_config=SchedulerConfig(max_num_scheduled_tokens=0),
                speculative_config=spec("eagle", 3),
            )
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(1\).*\(1\)"):
        build_cuda(seqs=1, tokens=1, speculative_config=spec("draft_model", 1))


def test_max_concurrent_batches(
    monkeypatch: pytest.MonkeyPatch, async_executor: None, triton_installed: None
) -> None:
    sync1 = build_cuda()
    sync1.scheduler_config.async_scheduling = False
    assert (sync1.max_concurrent_batches, sync1.max_in_flight_tokens) == (1, 8192)
    async_v2 = build_cuda()
    assert async_v2.scheduler_config.async_scheduling is True and async_v2.use_v2_model_runner
    assert (async_v2.max_concurrent_batches, async_v2.max_in_flight_tokens) == (2, 16384)
    pp4 = build_cuda(parallel_config=ParallelConfig(pipeline_parallel_size=4))
    assert (pp4.max_concurrent_batches, pp4.max_in_flight_tokens) == (5, 40960)
    pp4.scheduler_config.async_scheduling = False
    assert (pp4.max_concurrent_batches, pp4.max_in_flight_tokens) == (4, 32768)
    monkeypatch.setenv("PAGEDLLM_USE_V2_MODEL_RUNNER", "0")
    assert (async_v2.max_concurrent_batches, async_v2.max_in_flight_tokens) == (2, 16384)
    pp4.scheduler_config.async_scheduling = True
    pp4.parallel_config.pipeline_parallel_size = 2
    assert (pp4.max_concurrent_batches, pp4.max_in_flight_tokens) == (2, 16384)


def test_needs_dp_coordinator(tmp_path: Path) -> None:
    assert build_cuda().needs_dp_coordinator is False
    with override_platform("cuda", capability=(9, 0)), allow_unsupported():
        assert EngineConfig(parallel_config=ParallelConfig(data_parallel_size=2)).needs_dp_coordinator is True
    assert build_cuda(parallel_config=ParallelConfig(data_parallel_size=2)).needs_dp_coordinator is True
    external = ParallelConfig(data_parallel_size=2, data_parallel_external_lb=True)
    assert build_cuda(parallel_config=external).needs_dp_coordinator is False
    moe = write_hf_dir(tmp_path, num_local_experts=8)
    external = ParallelConfig(data_parallel_size=2, data_parallel_external_lb=True)
    assert build_cuda(model=moe, parallel_config=external).needs_dp_coordinator is True


# -- 6.5 async scheduling ------------------------------------------------------------------------------
def test_async_auto_generate(async_executor: None) -> None:
    cfg = build_cuda()
    assert cfg.scheduler_config.async_scheduling is True
    assert cfg.parallel_config.disable_nccl_for_dp_synchronization is True


def test_async_auto_pooling(async_executor: None) -> None:
    with override_platform("cuda", capability=(9, 0)), allow_unsupported():
        cfg = EngineConfig(model_config=ModelConfig(pooler_config={}))
    assert cfg.scheduler_config.async_scheduling is False
    assert cfg.parallel_config.disable_nccl_for_dp_synchronization is False


def test_async_auto_ngram_off(async_executor: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(speculative_config=spec("ngram", 3))
    assert cfg.scheduler_config.async_scheduling is False
    assert "ngram" in caplog.text


def test_async_auto_eagle3_disables_cascade(async_executor: None) -> None:
    cfg = build_cuda(speculative_config=spec("eagle3", 3))
    assert cfg.scheduler_config.async_scheduling is True
    assert cfg.model_config.disable_cascade_attn is True


def test_async_auto_pp_v1_off(async_executor, monkeypatch, caplog) -> None:
    monkeypatch.setenv("PAGEDLLM_USE_V2_MODEL_RUNNER", "0")
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(parallel_config=ParallelConfig(pipeline_parallel_size=2))
    assert cfg.scheduler_config.async_scheduling is False
    assert "pipeline parallelism" in caplog.text


def test_async_explicit_true_errors(async_executor: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with override_platform("cuda", capability=(9, 0)), allow_unsupported():
        with pytest.raises(ValueError, match="only EAGLE/MTP"):
            EngineConfig(
                model_config=ModelConfig(),
                scheduler_config=SchedulerConfig(async_scheduling=True),
                speculative_config=spec("medusa", 2),
            )
    monkeypatch.setitem(parallel_module.EXECUTOR_SUPPORTS_ASYNC, "uni", False)
    with override_platform("cuda", capability=(9, 0)):
        with pytest.raises(ValueError, match="async_scheduling=True is not supported by executor 'uni'"):
            EngineConfig(model_config=ModelConfig(), scheduler_config=SchedulerConfig(async_scheduling=True))


def test_async_explicit_false(async_executor: None) -> None:
    with override_platform("cuda", capability=(9, 0)):
        cfg = EngineConfig(
            model_config=ModelConfig(), scheduler_config=SchedulerConfig(async_scheduling=False)
        )
    assert cfg.scheduler_config.async_scheduling is False


def test_async_off_on_cpu() -> None:
    with override_platform("cpu"):
        assert EngineConfig(model_config=ModelConfig()).scheduler_config.async_scheduling is False


# -- 6.6 hybrid KV cache manager -----------------------------------------------------------------------
def test_hybrid_manager_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert build_cuda().scheduler_config.disable_hybrid_kv_cache_manager is False
    with override_platform("cpu"):
        assert (
            EngineConfig(model_config=ModelConfig()).scheduler_config.disable_hybrid_kv_cache_manager is True
        )
        with pytest.raises(ValueError, match="explicitly enables the hybrid KV cache manager"):
            EngineConfig(
                model_config=ModelConfig(),
                scheduler_config=SchedulerConfig(disable_hybrid_kv_cache_manager=False),
            )
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        cfg = build_cuda(kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"))
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True
    assert "turning off the hybrid KV cache manager: KV connector NixlConnector" in caplog.text
    with override_platform("cuda", capability=(9, 0)):
        explicit = EngineConfig(
            model_config=ModelConfig(), scheduler_config=SchedulerConfig(disable_hybrid_kv_cache_manager=True)
        )
    assert explicit.scheduler_config.disable_hybrid_kv_cache_manager is True
    chunked = write_hf_dir(tmp_path, attention_chunk_size=64)
    cfg = build_cuda(model=chunked, speculative_config=spec("eagle", 2))
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is True


# -- 6.7 KV offloading ---------------------------------------------------------------------------------
def _offload(monkeypatch: pytest.MonkeyPatch, size: float, backend: str = "native", simple: bool = False):
    if simple:
        monkeypatch.setenv("PAGEDLLM_USE_SIMPLE_KV_OFFLOAD", "1")
    cache = CacheConfig(kv_offloading_size=size, kv_offloading_backend=backend)
    return build_cuda(cache_config=cache).kv_transfer_config


def test_kv_offloading(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _offload(monkeypatch, 4)
    assert (kv.kv_connector, kv.kv_connector_extra_config, kv.kv_role) == (
        "OffloadingConnector",
        {"cpu_bytes_to_use": 4294967296},
        "kv_both",
    )
    half = _offload(monkeypatch, 0.5).kv_connector_extra_config["cpu_bytes_to_use"]
    assert half == 536870912.0 and isinstance(half, float)
    lm = _offload(monkeypatch, 4, backend="lmcache")
    assert (lm.kv_connector, lm.kv_connector_extra_config, lm.kv_role) == (
        "LMCacheMPConnector",
        {},
        "kv_both",
    )
    assert _offload(monkeypatch, 4, simple=True).kv_connector == "SimpleCPUOffloadConnector"
    assert build_cuda().kv_transfer_config is None


def test_kv_connector_with_expandable_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments"):
        _offload(monkeypatch, 1)


# -- 6.10 end state of a typical construction ----------------------------------------------------------
def test_typical_end_state(async_executor: None) -> None:
    cfg = build_cuda()
    cc = cfg.compilation_config
    assert cfg.instance_id.isdigit()
    assert cfg.optimization_level == OptimizationLevel.O2
    assert cc.mode == CompilationMode.VLLM_COMPILE and cc.custom_ops == ["none"] and cc.ir_enable_torch_wrap
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert (cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, cc.cudagraph_num_of_warmups) == (
        G512,
        512,
        1,
    )
    assert cc.compile_ranges_endpoints == [8192]
    assert cc.pass_config.fuse_allreduce_rms is False
    sc, pc = cfg.scheduler_config, cfg.parallel_config
    assert sc.async_scheduling is True and sc.max_num_scheduled_tokens is None
    assert pc.disable_nccl_for_dp_synchronization is True and sc.disable_hybrid_kv_cache_manager is False
    assert pc.enable_batch_sharded_sampling is False and cfg.kv_transfer_config is None
    assert (cfg.max_concurrent_batches, cfg.max_in_flight_tokens, cfg.needs_dp_coordinator) == (
        2,
        16384,
        False,
    )
    assert (cfg.uniform_decode_query_len, cfg.num_lookahead_tokens) == (1, 0)


def test_typical_end_state_eager() -> None:
    cfg = build_cuda(eager=True)
    cc = cfg.compilation_config
    assert (cc.mode, cc.custom_ops, cc.ir_enable_torch_wrap, cc.cudagraph_mode) == (
        CompilationMode.NONE,
        ["all"],
        False,
        CUDAGraphMode.NONE,
    )
    assert (cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size) == ([], 0)
    assert cfg.kernel_config.enable_jit_warmup is False and cc.cudagraph_num_of_warmups == 0
    assert cc.compile_ranges_endpoints == [8192]
