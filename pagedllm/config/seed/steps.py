"""The construction steps of the spec's procedure (P01-P72) that concern only features pagedllm does not
run: Mamba state, DeepGEMM and block-wise fp8, data-parallel NCCL, cascade attention, multimodal IPC,
Turing GPUs, dynamic speculation under CUDA graphs, diffusion, dual batch overlap, HiSparse, cuMem.
`construct` calls each at its paragraph; most of them only warn, the rest refuse a contradiction."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pagedllm import envs
from pagedllm.config.compilation import CUDAGraphMode
from pagedllm.config.utils import get_platform, info_once, warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")


def set_dcp_defaults(cfg: EngineConfig) -> None:
    """P09."""
    cfg.parallel_config.set_dcp_defaults()


def check_mamba_stochastic_rounding(cfg: EngineConfig) -> None:
    """P16."""
    if cfg.mamba_config.enable_stochastic_rounding and cfg.cache_config.mamba_ssm_cache_dtype != "float16":
        raise ValueError(
            "mamba_config.enable_stochastic_rounding needs cache_config.mamba_ssm_cache_dtype='float16'"
        )


def disable_deep_gemm(cfg: EngineConfig) -> None:
    """P19."""
    quant, mc = cfg.quant_config, cfg.model_config
    if quant is not None and getattr(quant, "use_deep_gemm", False) is None:
        # pagedllm has no DeepGEMM kernels, so the auto-disable list covers every model type.
        warning_once(f"DeepGEMM is disabled for model_type={mc.model_type if mc else None}")
        quant.use_deep_gemm = False


def resolve_dp_synchronization(cfg: EngineConfig) -> None:
    """P22."""
    pc, mc = cfg.parallel_config, cfg.model_config
    if pc.disable_nccl_for_dp_synchronization is not None:
        return
    if cfg.scheduler_config.async_scheduling:
        if pc.data_parallel_size > 1 and (mc is None or mc.is_moe):
            info_once("async scheduling: data parallel ranks synchronize over gloo")
        pc.disable_nccl_for_dp_synchronization = True
    else:
        pc.disable_nccl_for_dp_synchronization = False


def disable_cascade_with_async_speculation(cfg: EngineConfig) -> None:
    """P23."""
    mc = cfg.model_config
    if cfg.speculative_config is not None and cfg.scheduler_config.async_scheduling:
        if mc is not None and not mc.disable_cascade_attn:
            warning_once("cascade attention is disabled with async scheduling and speculative decoding")
            mc.disable_cascade_attn = True


def check_mm_tensor_ipc(cfg: EngineConfig) -> None:
    """P25."""
    mc = cfg.model_config
    mm = mc.multimodal_config if mc is not None else None
    if mm and mm.get("mm_tensor_ipc") == "torch_shm":
        if envs.PAGEDLLM_WORKER_MULTIPROC_METHOD != "spawn":
            raise ValueError("mm_tensor_ipc='torch_shm' needs PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn")


def warn_turing_float32(cfg: EngineConfig) -> None:
    """P26."""
    mc = cfg.model_config
    if (
        mc is not None
        and cfg.scheduler_config.enable_chunked_prefill
        and mc.dtype == torch.float32
        and get_platform().is_device_capability((7, 5))
    ):
        warning_once("Turing GPU with float32 and chunked prefill: kernels use IEEE precision")


def _blocked_weights(quant: Any) -> bool:
    if quant is None:
        return False
    if hasattr(quant, "weight_block_size"):
        return quant.weight_block_size is not None
    if hasattr(quant, "has_blocked_weights"):
        return bool(quant.has_blocked_weights())
    return False


def add_quant_fp8_op(cfg: EngineConfig) -> None:
    """P31 and P69: block-wise fp8 weights need the `quant_fp8` custom op."""
    ops = cfg.compilation_config.custom_ops
    if _blocked_weights(cfg.quant_config) and "-quant_fp8" not in ops:
        ops.append("+quant_fp8")


def dynamic_speculation_graphs(cfg: EngineConfig) -> None:
    """P39."""
    spec, cc = cfg.speculative_config, cfg.compilation_config
    if (
        spec is not None
        and spec.uses_dynamic_speculative_decoding()
        and cc.cudagraph_mode is not None
        and cc.cudagraph_mode.has_full_cudagraphs()
        and not cfg.use_v2_model_runner
    ):
        warning_once("dynamic speculative decoding needs PIECEWISE CUDA graphs on the V1 runner")
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE


def set_diffusion_scheduler(cfg: EngineConfig) -> None:
    """P49."""
    sc = cfg.scheduler_config
    if cfg.diffusion_config is not None and sc.scheduler_cls is None:
        module = "pagedllm.core.diffusion_scheduler"
        sc.scheduler_cls = (
            f"{module}.AsyncDiffusionScheduler" if sc.async_scheduling else f"{module}.DiffusionScheduler"
        )


def disable_cascade_for_batch_invariance(cfg: EngineConfig) -> None:
    """P60."""
    mc = cfg.model_config
    if mc is not None and envs.PAGEDLLM_BATCH_INVARIANT and not mc.disable_cascade_attn:
        warning_once("batch invariance: cascade attention is disabled")
        mc.disable_cascade_attn = True


def check_dual_batch_overlap(cfg: EngineConfig) -> None:
    """P61."""
    pc, mc = cfg.parallel_config, cfg.model_config
    if not pc.use_ubatching:
        return
    assert pc.all2all_backend in ("deepep_low_latency", "deepep_high_throughput", "nixl_ep"), (
        f"dual batch overlap needs a DeepEP or NIXL-EP all2all backend, not {pc.all2all_backend}"
    )
    if mc is not None and not mc.disable_cascade_attn:
        warning_once("dual batch overlap: cascade attention is disabled")
        mc.disable_cascade_attn = True


def check_hisparse_kv_cache_manager(cfg: EngineConfig) -> None:
    """P67."""
    if (
        cfg.attention_config.hisparse_config is not None
        and cfg.scheduler_config.disable_hybrid_kv_cache_manager
    ):
        raise ValueError("HiSparse needs the hybrid KV cache manager, which is disabled")


def check_connector_allocator(cfg: EngineConfig) -> None:
    """P70."""
    kv, mc = cfg.kv_transfer_config, cfg.model_config
    if kv is None or kv.kv_connector is None:
        return
    alloc = envs.PYTORCH_CUDA_ALLOC_CONF or ""
    if "expandable_segments:True" in alloc and not (mc is not None and mc.enable_cumem_allocator):
        raise ValueError(
            "KV connectors register KV memory, which PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "remaps; unset that option or enable the cuMem allocator (enable_cumem_allocator=True)"
        )


def check_nccl_graph_register(cfg: EngineConfig) -> None:
    """P71."""
    if cfg.use_cumem_cudagraph_pool:
        # The reference writes NCCL_GRAPH_REGISTER=0 when unset; pagedllm's config never writes
        # os.environ, and it creates no NCCL communicator yet, so only a conflicting value is reported.
        current = envs.NCCL_GRAPH_REGISTER
        if current is not None and current != "0":
            logger.warning("NCCL_GRAPH_REGISTER=%s with CUDA graphs in the cuMem pool may fail", current)
