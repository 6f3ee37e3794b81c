"""Each sub-config's compute_hash: a graph-affecting field changes it, an excluded field does not."""

from __future__ import annotations

from typing import Any

import pytest

from pagedllm.config import (
    AttentionConfig,
    AuxOutputConfig,
    CacheConfig,
    CompilationConfig,
    KernelConfig,
    KVTransferConfig,
    LoRAConfig,
    MambaConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    PassConfig,
    ProfilerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)

CASES: list[tuple[type, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    (CacheConfig, {}, {"block_size": 32}, {"gpu_memory_utilization": 0.5}),
    (ParallelConfig, {}, {"tensor_parallel_size": 2}, {"disable_custom_all_reduce": True}),
    (CompilationConfig, {}, {"backend": "eager"}, {"cache_dir": "/elsewhere"}),
    (PassConfig, {}, {"fuse_norm_quant": True}, {}),
    (KernelConfig, {}, {"ir_op_priority": {"rms_norm": ["other"]}}, {"enable_jit_warmup": False}),
    (
        SpeculativeConfig,
        {"method": "eagle", "num_speculative_tokens": 2},
        {"num_speculative_tokens": 3},
        {"prompt_lookup_max": 4},
    ),
    (LoRAConfig, {}, {"max_lora_rank": 8}, {"max_cpu_loras": 4}),
    (ModelConfig, {}, {"dtype": "float16"}, {"served_model_name": "other"}),
    (AttentionConfig, {}, {"backend": "triton_paged"}, {}),
    (OffloadConfig, {}, {"cpu_offload_gb": 1}, {}),
    (MambaConfig, {}, {"backend": "flashinfer"}, {}),
    (AuxOutputConfig, {}, {"return_routed_experts": True}, {}),
    (KVTransferConfig, {}, {"kv_connector": "NixlConnector"}, {"engine_id": "e1"}),
    (StructuredOutputsConfig, {}, {"backend": "xgrammar"}, {"disable_fallback": True}),
    (ProfilerConfig, {}, {"profiler": "torch"}, {"torch_profiler_dir": "/tmp/prof"}),
]


@pytest.mark.parametrize(("cls", "base", "graph", "excluded"), CASES, ids=[c[0].__name__ for c in CASES])
def test_sub_config_hash(cls: type, base: dict, graph: dict, excluded: dict) -> None:
    reference = cls(**base).compute_hash()
    assert cls(**base).compute_hash() == reference
    assert cls(**{**base, **graph}).compute_hash() != reference
    if excluded:
        assert cls(**{**base, **excluded}).compute_hash() == reference
