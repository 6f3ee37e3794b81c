"""What a plain construction gives on this CPU machine (the platform pagedllm's tests run on)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.config import CompilationMode, CUDAGraphMode, EngineConfig, ModelConfig, OptimizationLevel
from pagedllm.platforms import override_platform
from pagedllm.platforms.cpu import CpuPlatform


def test_cpu_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: False))
    with override_platform("cpu"):
        cfg = EngineConfig(model_config=ModelConfig())
    sc, cc = cfg.scheduler_config, cfg.compilation_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs, sc.max_model_len) == (4096, 256, 8192)
    assert cfg.model_config.dtype == torch.float32 and cfg.device_config.device == torch.device("cpu")
    assert cc.mode == CompilationMode.VLLM_COMPILE and cc.backend == "inductor"
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.compile_ranges_endpoints == [4096]
    monkeypatch.setattr(CpuPlatform, "has_native_bf16", staticmethod(lambda: True))
    with override_platform("cpu"):
        assert EngineConfig(model_config=ModelConfig()).model_config.dtype == torch.bfloat16
    assert sc.async_scheduling is False and cfg.max_concurrent_batches == 1
    assert cfg.cache_config.block_size == 16 and cfg.cache_config.enable_prefix_caching
    assert cfg.parallel_config.distributed_executor_backend == "uni"


def test_cpu_o0_is_eager() -> None:
    with override_platform("cpu"):
        cfg = EngineConfig(model_config=ModelConfig(), optimization_level=OptimizationLevel.O0)
    assert cfg.compilation_config.mode == CompilationMode.NONE
    assert cfg.compilation_config.custom_ops == ["all"]


def test_no_model_config() -> None:
    with override_platform("cpu"):
        cfg = EngineConfig()
    assert cfg.model_config is None and cfg.scheduler_config.max_model_len is None
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert len(cfg.compute_hash()) == 10


def test_scheduler_gets_model_len(tiny_llama_dir) -> None:
    with override_platform("cpu"):
        cfg = EngineConfig(model_config=ModelConfig(model=str(tiny_llama_dir), max_model_len=256))
    assert cfg.scheduler_config.max_model_len == 256


def test_pickle_and_deepcopy_keep_the_resolved_config() -> None:
    # The multiprocess executor sends the config to workers by pickling it.
    import copy
    import pickle

    cfg = EngineConfig(model_config=ModelConfig(dtype="float16"))
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert clone.compute_hash() == cfg.compute_hash()
        assert clone.model_config.gguf_file == cfg.model_config.gguf_file
        assert clone.model_config.dtype == torch.float16


def test_cuda_defaults_without_a_gpu() -> None:
    """The same plain construction as on a Hopper GPU (contract: CUDA budget 8192, bf16 by default)."""
    from pagedllm.config.support import unsupported_features

    with override_platform("cuda", capability=(9, 0)):
        cfg = EngineConfig(model_config=ModelConfig())
    sc, cc = cfg.scheduler_config, cfg.compilation_config
    assert (sc.max_num_batched_tokens, sc.max_num_seqs) == (8192, 256)
    assert cfg.model_config.dtype == torch.bfloat16 and cfg.device_config.device == torch.device("cuda")
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE and cc.max_cudagraph_capture_size == 512
    assert cc.padded_graph_size(3) == 4 and cc.compile_ranges_endpoints == [8192]
    # The executor cannot overlap steps yet, so async scheduling resolves to off (no error).
    assert sc.async_scheduling is False and cfg.max_concurrent_batches == 1
    assert unsupported_features(cfg) == []
