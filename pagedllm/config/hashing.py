"""EngineConfig.compute_hash (spec 5.21) and the one-line __str__ (spec 5.15)."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from pagedllm.config.utils import safe_hash

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig


def engine_version() -> str:
    try:
        return version("pagedllm")
    except PackageNotFoundError:
        return "0.0.0+local"


def _hash_or_none(sub: Any) -> str:
    return sub.compute_hash() if sub else "None"


def hash_factors(cfg: EngineConfig, include_version: bool = True) -> list[Any]:
    """The ordered list whose string is hashed; exposed so tests can check the structure."""
    factors: list[Any] = []
    if include_version:
        factors.append(engine_version())
    mc = cfg.model_config
    factors.append(mc.compute_hash() if mc is not None else "None")
    if (
        mc is not None
        and getattr(cfg.compilation_config, "compile_mm_encoder", False)
        and mc.multimodal_config
    ):
        factors.append(safe_hash(json.dumps(mc.multimodal_config, sort_keys=True, default=str).encode()))
    for sub in (
        cfg.cache_config,
        cfg.parallel_config,
        cfg.scheduler_config,
        cfg.device_config,
        cfg.load_config,
        cfg.offload_config,
        cfg.attention_config,
    ):
        factors.append(_hash_or_none(sub))
    factors.append(cfg.engram_config.compute_hash() if cfg.engram_config is not None else "None")
    factors.append(_hash_or_none(cfg.lora_config))
    factors.append(_hash_or_none(cfg.speculative_config))
    if cfg.structured_outputs_config:
        factors.append(cfg.structured_outputs_config.compute_hash())
    factors.append(_hash_or_none(cfg.profiler_config))
    factors.append(cfg.observability_config.compute_hash())
    factors.append(_hash_or_none(cfg.compilation_config))
    # Upstream puts the Python None object (not the string) here when there is no kernel config.
    factors.append(cfg.kernel_config.compute_hash() if cfg.kernel_config else None)
    factors.append(_hash_or_none(cfg.kv_transfer_config))
    factors.append(_hash_or_none(cfg.ec_transfer_config))
    factors.append(cfg.aux_output_config.compute_hash())
    extra = cfg.additional_config
    if extra:
        if isinstance(extra, dict):
            factors.append(safe_hash(json.dumps(extra, sort_keys=True).encode()))
        else:
            factors.append(extra.compute_hash())
    else:
        factors.append("None")
    return factors


def hash_factor_list(factors: list[Any]) -> str:
    return safe_hash(str([factors]).encode())[:10]


def engine_config_hash(cfg: EngineConfig, include_version: bool = True) -> str:
    return hash_factor_list(hash_factors(cfg, include_version))


def engine_config_str(cfg: EngineConfig) -> str:
    mc = cfg.model_config
    if mc is None:
        raise ValueError("EngineConfig.__str__ needs a model_config")
    cc, pc, sc, lc = cfg.cache_config, cfg.parallel_config, cfg.scheduler_config, cfg.load_config
    items: list[tuple[str, Any]] = [
        ("model", repr(mc.model)),
        ("speculative_config", repr(cfg.speculative_config)),
        ("tokenizer", repr(mc.tokenizer)),
        ("skip_tokenizer_init", mc.skip_tokenizer_init),
        ("tokenizer_mode", mc.tokenizer_mode),
        ("revision", mc.revision),
        ("tokenizer_revision", mc.tokenizer_revision),
        ("trust_remote_code", mc.trust_remote_code),
        ("dtype", mc.dtype),
        ("max_seq_len", mc.max_model_len),
        ("download_dir", repr(lc.download_dir)),
        ("load_format", lc.load_format),
        ("tensor_parallel_size", pc.tensor_parallel_size),
        ("pipeline_parallel_size", pc.pipeline_parallel_size),
        ("data_parallel_size", pc.data_parallel_size),
        ("decode_context_parallel_size", pc.decode_context_parallel_size),
        ("dcp_comm_backend", pc.dcp_comm_backend),
        ("disable_custom_all_reduce", pc.disable_custom_all_reduce),
        ("quantization", mc.quantization),
        ("quantization_config", cfg.quant_config),
        ("enforce_eager", mc.enforce_eager),
        ("aux_output_config", repr(cfg.aux_output_config)),
        ("kv_cache_dtype", cc.cache_dtype),
        ("device_config", cfg.device_config.device),
        ("structured_outputs_config", repr(cfg.structured_outputs_config)),
        ("observability_config", repr(cfg.observability_config)),
        ("seed", mc.seed),
        ("served_model_name", mc.served_model_name),
        ("enable_prefix_caching", cc.enable_prefix_caching),
        ("enable_chunked_prefill", sc.enable_chunked_prefill),
        ("pooler_config", repr(mc.pooler_config)),
        ("compilation_config", repr(cfg.compilation_config)),
        ("kernel_config", repr(cfg.kernel_config)),
    ]
    return ", ".join(f"{key}={value}" for key, value in items)
