"""compute_hash: the spec 6.8 structure, stability across processes, sensitivity to graph-affecting
fields and insensitivity to excluded ones."""

from __future__ import annotations

import subprocess
import sys

import pytest
from config_testing import build_cuda

from pagedllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedllm.config import hashing as hashing_module
from pagedllm.config.hashing import hash_factor_list, hash_factors

_MOCKS = {
    "model_config": "MODEL",
    "cache_config": "CACHE",
    "parallel_config": "PAR",
    "scheduler_config": "SCHED",
    "device_config": "DEV",
    "load_config": "LOAD",
    "offload_config": "OFF",
    "attention_config": "ATTN",
    "structured_outputs_config": "SO",
    "profiler_config": "PROF",
    "observability_config": "OBS",
    "compilation_config": "COMP",
    "kernel_config": "KERN",
    "aux_output_config": "AUX",
}


def _mocked() -> EngineConfig:
    cfg = EngineConfig(model_config=ModelConfig())
    for name, value in _MOCKS.items():
        getattr(cfg, name).compute_hash = lambda value=value: value
    return cfg


def test_spec_6_8_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _mocked()
    expected = ["MODEL", "CACHE", "PAR", "SCHED", "DEV", "LOAD", "OFF", "ATTN", "None", "None", "None", "SO"]
    expected += ["PROF", "OBS", "COMP", "KERN", "None", "None", "AUX", "None"]
    assert hash_factors(cfg, include_version=False) == expected
    assert cfg.compute_hash(include_version=False) == "120c836e4a"
    monkeypatch.setattr(hashing_module, "engine_version", lambda: "0.0.0")
    assert cfg.compute_hash() == "9964e722de"
    cfg.additional_config = {"b": 1, "a": 2}
    assert hash_factors(cfg, include_version=False)[-1] == "5e4d14d82c320bafb2f1286fe486d1f8"
    assert cfg.compute_hash(include_version=False) == "3c78939bba"


def test_spec_6_8_kernel_absent_is_python_none() -> None:
    factors = ["MODEL", "CACHE", "PAR", "SCHED", "DEV", "LOAD", "OFF", "ATTN", "None", "None", "None", "SO"]
    factors += ["PROF", "OBS", "COMP", None, "None", "None", "AUX", "None"]
    assert hash_factor_list(factors) == "804f719f44"


def test_additional_config_object_hash() -> None:
    class Extra:
        def compute_hash(self) -> str:
            return "EXTRA"

    from pagedllm.config.support import allow_unsupported

    with allow_unsupported():
        cfg = EngineConfig(model_config=ModelConfig(), additional_config=Extra())
    assert hash_factors(cfg)[-1] == "EXTRA"
    # No platform plug-in reads it, so a normal construction refuses it rather than ignoring it.
    with pytest.raises(ValueError, match="does not support: additional_config"):
        EngineConfig(model_config=ModelConfig(), additional_config={"x": 1})


_SCRIPT = "from pagedllm.config import EngineConfig, ModelConfig; print(EngineConfig(model_config=ModelConfig()).compute_hash())"


def test_hash_equal_across_processes() -> None:
    runs = [
        subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    hashes = [r.stdout.strip().splitlines()[-1] for r in runs]
    assert hashes[0] == hashes[1]
    assert len(hashes[0]) == 10 and all(c in "0123456789abcdef" for c in hashes[0])
    assert EngineConfig(model_config=ModelConfig()).compute_hash() == hashes[0]


@pytest.mark.parametrize(
    "change",
    [
        {"model_config": {"dtype": "float16"}},
        {"model_config": {"max_model_len": 1024}},
        {"cache_config": {"block_size": 32}},
        {"cache_config": {"cache_dtype": "bfloat16"}},
        {"compilation": {"mode": 0}},
        {"compilation": {"cudagraph_capture_sizes": [1, 2, 4]}},
        {"compilation": {"custom_ops": ["all"]}},
        {"compilation": {"backend": "eager"}},
        {"optimization_level": 1},
        {"seqs": 8},
        {"tokens": 4096},
        {"additional_config": {"x": 1}},
        {"model_config": {"enforce_eager": True}},
        {"model_config": {"hf_overrides": {"rms_norm_eps": 1e-3}}},
        {"compilation": {"compile_ranges_endpoints": [512]}},
        {"compilation": {"pass_config": {"rope_kvcache_fusion_max_token_num": 128}}},
        {"performance_mode": "interactivity"},
    ],
)
def test_graph_affecting_change_changes_hash(change: dict) -> None:
    base = build_cuda().compute_hash()
    kwargs = dict(change)
    if "model_config" in kwargs:
        from pagedllm.config.support import allow_unsupported
        from pagedllm.platforms import override_platform

        with override_platform("cuda", capability=(9, 0)), allow_unsupported():
            other = EngineConfig(
                model_config=ModelConfig(**kwargs.pop("model_config")),
                scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
            )
    else:
        if "cache_config" in kwargs:
            kwargs["cache_config"] = CacheConfig(**kwargs["cache_config"])
        other = build_cuda(**kwargs)
    assert other.compute_hash() != base


@pytest.mark.parametrize(
    "change",
    [
        {"shutdown_timeout": 30},
        {"performance_mode": "throughput"},
        {"cache_config": {"gpu_memory_utilization": 0.5}},
        {"cache_config": {"enable_prefix_caching": False}},
        {"compilation": {"cache_dir": "/tmp/elsewhere"}},
        {"compilation": {"debug_dump_path": "/tmp/dumps"}},
        {"cache_config": {"num_gpu_blocks_override": 64}},
        {"cache_config": {"kv_cache_memory_bytes": 2**30}},
    ],
)
def test_excluded_change_keeps_hash(change: dict) -> None:
    base = build_cuda().compute_hash()
    kwargs = dict(change)
    if "cache_config" in kwargs:
        kwargs["cache_config"] = CacheConfig(**kwargs["cache_config"])
    assert build_cuda(**kwargs).compute_hash() == base


def test_instance_id_not_hashed() -> None:
    a, b = build_cuda(), build_cuda()
    assert a.instance_id != b.instance_id or a.instance_id.isdigit()
    assert a.compute_hash() == b.compute_hash()


def test_model_fields_outside_the_graph_keep_hash() -> None:
    base = build_cuda().compute_hash()
    from pagedllm.config.support import allow_unsupported
    from pagedllm.platforms import override_platform

    for change in ({"seed": 7}, {"served_model_name": "other"}, {"tokenizer_mode": "slow"}):
        with override_platform("cuda", capability=(9, 0)), allow_unsupported():
            other = EngineConfig(
                model_config=ModelConfig(**change),
                scheduler_config=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
            )
        assert other.compute_hash() == base, change
