"""Optimization levels: the per-level default table, the fusion predicates it uses, and the
"fill only what is still None" application of it."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.config.compilation import CUDAGraphMode

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig


def _batch_invariant() -> bool:
    return bool(envs.PAGEDLLM_BATCH_INVARIANT)


def _aiter_enabled() -> bool:
    # AITER is ROCm's kernel library; pagedllm has no ROCm platform, so it is never enabled.
    from pagedllm.platforms import current_platform

    return current_platform.is_rocm()


def _flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def enable_norm_fusion(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    return (
        cc.is_custom_op_enabled("rms_norm")
        or cc.is_custom_op_enabled("quant_fp8")
        or cfg.kernel_config.ir_op_priority.rms_norm[:1] not in ([], ["native"])
    )


def enable_act_fusion(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    mc = cfg.model_config
    return (
        cc.is_custom_op_enabled("silu_and_mul")
        or cc.is_custom_op_enabled("quant_fp8")
        or (mc is not None and mc.is_nvfp4_quantized())
    )


def enable_allreduce_rms_fusion(cfg: EngineConfig) -> bool:
    from pagedllm.platforms import current_platform

    if _batch_invariant():
        return False
    tp = cfg.parallel_config.tensor_parallel_size
    if current_platform.is_rocm():
        return _aiter_enabled() and tp > 1
    return (
        tp > 1
        and current_platform.is_cuda()
        and _flashinfer_installed()
        and (current_platform.is_device_capability_family(100) or current_platform.is_device_capability(90))
    )


def _kv_update_not_split(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    return bool(cc.use_inductor_graph_partition) or not cc.splitting_ops_contain_kv_cache_update()


def enable_rope_kvcache_fusion(cfg: EngineConfig) -> bool:
    cc = cfg.compilation_config
    return _aiter_enabled() and cc.is_custom_op_enabled("rotary_embedding") and _kv_update_not_split(cfg)


def enable_rope_kvcache_mla_fusion(cfg: EngineConfig) -> bool:
    return _kv_update_not_split(cfg)


def enable_norm_pad_fusion(cfg: EngineConfig) -> bool:
    mc = cfg.model_config
    providers = cfg.kernel_config.ir_op_priority.fused_add_rms_norm
    return providers[:1] == ["aiter"] and mc is not None and mc.get_hidden_size() == 2880


def enable_mla_dual_rms_norm_fusion(cfg: EngineConfig) -> bool:
    return _aiter_enabled()


def enable_qk_norm_rope_kvcache(cfg: EngineConfig) -> bool:
    return _aiter_enabled() and cfg.compilation_config.is_custom_op_enabled("rotary_embedding")


def _is_quantized(cfg: EngineConfig) -> bool:
    # Placeholder of the upstream table: attention-quant fusion is keyed on "is quantized", which the
    # table currently evaluates to a constant False.
    return False


def _is_dense(cfg: EngineConfig) -> bool:
    # Same upstream placeholder for sequence parallelism and GEMM/collective overlap.
    return False


Default = bool | CUDAGraphMode | Callable[["EngineConfig"], bool]


def _level_table(level: int) -> dict[str, Any]:
    if level == 0:
        passes: dict[str, Default] = {
            key: False
            for key in (
                "fuse_norm_quant",
                "fuse_act_quant",
                "fuse_allreduce_rms",
                "fuse_attn_quant",
                "enable_sp",
                "fuse_gemm_comms",
                "fuse_act_padding",
                "fuse_mla_dual_rms_norm",
                "fuse_rope_kvcache",
                "fuse_qk_norm_rope_kvcache",
                "enable_qk_norm_rope_fusion",
                "fuse_rope_kvcache_cat_mla",
            )
        }
        graph_mode = CUDAGraphMode.NONE
    else:
        full = level >= 2
        passes = {
            "fuse_norm_quant": enable_norm_fusion,
            "fuse_act_quant": enable_act_fusion,
            "fuse_allreduce_rms": enable_allreduce_rms_fusion if full else False,
            "fuse_attn_quant": _is_quantized if full else False,
            "enable_sp": _is_dense if full else False,
            "fuse_gemm_comms": _is_dense if full else False,
            "fuse_act_padding": enable_norm_pad_fusion,
            "fuse_mla_dual_rms_norm": enable_mla_dual_rms_norm_fusion,
            "fuse_rope_kvcache": enable_rope_kvcache_fusion if full else False,
            "fuse_qk_norm_rope_kvcache": enable_qk_norm_rope_kvcache if full else False,
            "enable_qk_norm_rope_fusion": False,
            "fuse_rope_kvcache_cat_mla": enable_rope_kvcache_mla_fusion if full else False,
        }
        graph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if full else CUDAGraphMode.PIECEWISE
    return {
        "compilation_config": {
            "cudagraph_mode": graph_mode,
            "use_inductor_graph_partition": False,
            "pass_config": passes,
        },
        "kernel_config": {"enable_flashinfer_autotune": level > 0},
    }


# Level -> nested defaults; callables are evaluated with the root config when applied.
OPTIMIZATION_LEVEL_TO_CONFIG: dict[int, dict[str, Any]] = {level: _level_table(level) for level in range(4)}


def set_config_default(cfg: EngineConfig, obj: Any, key: str, value: Any) -> None:
    """Set `obj.key` only if it is None; a callable default is called with the root config."""
    if getattr(obj, key) is None:
        setattr(obj, key, value(cfg) if callable(value) else value)


def apply_optimization_level_defaults(cfg: EngineConfig, defaults: dict[str, Any]) -> None:
    def apply(obj: Any, table: dict[str, Any]) -> None:
        for key, value in table.items():
            if not hasattr(obj, key):
                continue
            current = getattr(obj, key)
            if isinstance(value, dict) and dataclasses.is_dataclass(current):
                apply(current, value)
            else:
                set_config_default(cfg, obj, key, value)

    apply(cfg, defaults)
