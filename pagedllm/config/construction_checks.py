"""Construction steps with their own rules (spec 5.4 async scheduling, 5.13 KV offloading as a connector,
P59 and P68), split from `construction.py` to keep each module readable; `construct` calls them in order."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.config.compilation import CompilationMode
from pagedllm.config.speculative import EAGLE_FAMILY, NGRAM_GPU_METHODS
from pagedllm.config.utils import get_platform, warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

ASYNC_OK_METHODS = EAGLE_FAMILY | NGRAM_GPU_METHODS | {"draft_model", "dspark", "dflash"}
NIXL_CONNECTOR = "NixlConnector"


def resolve_async_scheduling(
    cfg: EngineConfig, executor_async: bool, rocm_deepep_ht_dbo: bool = False
) -> None:
    """P21 / spec 5.4."""
    sc, spec, pc, mc = cfg.scheduler_config, cfg.speculative_config, cfg.parallel_config, cfg.model_config
    backend = pc.distributed_executor_backend
    if sc.async_scheduling is True:
        if rocm_deepep_ht_dbo:
            raise ValueError(
                "async_scheduling is not supported with DBO and the DeepEP high-throughput backend on ROCm"
            )
        if spec is not None:
            if spec.method not in ASYNC_OK_METHODS:
                raise ValueError(
                    f"async_scheduling supports only EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash speculative "
                    f"decoding, not method {spec.method!r}"
                )
            if spec.disable_padded_drafter_batch:
                raise ValueError("async_scheduling is not compatible with disable_padded_drafter_batch=True")
        if not executor_async:
            raise ValueError(
                f"async_scheduling=True is not supported by executor {backend!r} on {get_platform().device_type}"
            )
        return
    if sc.async_scheduling is False:
        return
    if mc is not None and mc.runner_type == "pooling":
        logger.debug("async scheduling off for pooling models")
        sc.async_scheduling = False
    elif spec is not None and spec.method not in ASYNC_OK_METHODS:
        warning_once(f"async scheduling is off: speculative method {spec.method!r} does not support it")
        sc.async_scheduling = False
    elif spec is not None and spec.disable_padded_drafter_batch:
        warning_once("async scheduling is off: disable_padded_drafter_batch=True")
        sc.async_scheduling = False
    elif not executor_async:
        # On a platform without async support (CPU) this is the normal case, not worth a warning.
        if get_platform().supports_async_scheduling():
            warning_once(f"async scheduling is off: executor {backend!r} does not support it")
        else:
            logger.debug("async scheduling is not available on %s", get_platform().device_type)
        sc.async_scheduling = False
    elif rocm_deepep_ht_dbo:
        warning_once("async scheduling is off: DBO with DeepEP high-throughput on ROCm")
        sc.async_scheduling = False
    elif pc.pipeline_parallel_size > 1 and not cfg.use_v2_model_runner:
        warning_once("async scheduling is off: pipeline parallelism needs the V2 model runner for it")
        sc.async_scheduling = False
    else:
        sc.async_scheduling = True


def post_init_kv_transfer_config(cfg: EngineConfig) -> None:
    """P64 / spec 5.13: KV offloading is expressed as a KV connector."""
    from pagedllm.config.kv_transfer import KVTransferConfig

    cc = cfg.cache_config
    if cc.kv_offloading_size is None:
        return
    if cfg.kv_transfer_config is None:
        cfg.kv_transfer_config = KVTransferConfig()
    kv = cfg.kv_transfer_config
    if cc.kv_offloading_backend == "native":
        simple = envs.PAGEDLLM_USE_SIMPLE_KV_OFFLOAD
        kv.kv_connector = "SimpleCPUOffloadConnector" if simple else "OffloadingConnector"
        kv.kv_connector_extra_config.update({"cpu_bytes_to_use": cc.kv_offloading_size * 2**30})
    elif cc.kv_offloading_backend == "lmcache":
        kv.kv_connector = "LMCacheMPConnector"
    kv.kv_role = "kv_both"


def final_cuda_checks(cfg: EngineConfig, breakable: bool) -> None:
    """P59."""
    cc, mc = cfg.compilation_config, cfg.model_config
    if not get_platform().is_cuda_alike():
        return
    mode = cc.cudagraph_mode
    assert mode is not None
    if (
        mode.has_full_cudagraphs()
        and mc is not None
        and not mc.disable_cascade_attn
        and not mode.has_piecewise_cudagraphs()
    ):
        warning_once("batches using cascade attention run eagerly (no piecewise CUDA graphs to fall back to)")
    if mode.requires_piecewise_compilation():
        assert cc.mode == CompilationMode.VLLM_COMPILE or breakable, (
            f"cudagraph_mode {mode.name} needs compilation mode VLLM_COMPILE, got {cc.mode}"
        )


def resolve_debug_dump_path(cfg: EngineConfig) -> None:
    """P68 (made absolute before ~ expansion, as specified)."""
    cc = cfg.compilation_config
    if cc.debug_dump_path is not None:
        cc.debug_dump_path = cc.debug_dump_path.absolute().expanduser()
    env = envs.PAGEDLLM_DEBUG_DUMP_PATH
    if env:
        if cc.debug_dump_path is not None:
            logger.warning("PAGEDLLM_DEBUG_DUMP_PATH overrides compilation_config.debug_dump_path")
        cc.debug_dump_path = Path(env).absolute().expanduser()
