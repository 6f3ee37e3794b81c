"""Construction steps with their own rules (spec 5.4, 5.5, 5.13 and the P5x validations), split from
`construction.py` to keep each module readable; `construct` calls them in the spec's order."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.config.compilation import CompilationMode, CUDAGraphMode
from pagedllm.config.speculative import EAGLE_FAMILY, NGRAM_GPU_METHODS
from pagedllm.config.utils import info_once, warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

ASYNC_OK_METHODS = EAGLE_FAMILY | NGRAM_GPU_METHODS | {"draft_model", "dspark", "dflash"}
NIXL_CONNECTOR = "NixlConnector"


def _platform() -> Any:
    from pagedllm.platforms import current_platform

    return current_platform


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
                f"async_scheduling=True is not supported by executor {backend!r} on {_platform().device_type}"
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
        if _platform().supports_async_scheduling():
            warning_once(f"async scheduling is off: executor {backend!r} does not support it")
        else:
            logger.debug("async scheduling is not available on %s", _platform().device_type)
        sc.async_scheduling = False
    elif rocm_deepep_ht_dbo:
        warning_once("async scheduling is off: DBO with DeepEP high-throughput on ROCm")
        sc.async_scheduling = False
    elif pc.pipeline_parallel_size > 1 and not cfg.use_v2_model_runner:
        warning_once("async scheduling is off: pipeline parallelism needs the V2 model runner for it")
        sc.async_scheduling = False
    else:
        sc.async_scheduling = True


def resolve_hybrid_kv_cache_manager(cfg: EngineConfig) -> None:
    """P66 / spec 5.5."""
    sc, mc, spec = cfg.scheduler_config, cfg.model_config, cfg.speculative_config
    need_disable = not _platform().support_hybrid_kv_cache()
    if mc is not None and mc.attention_chunk_size is not None:
        if spec is not None and spec.use_eagle():
            need_disable = True
        elif not envs.PAGEDLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE:
            logger.warning(
                "chunked local attention with the hybrid KV cache manager has a latency regression"
            )
            need_disable = True
    if sc.disable_hybrid_kv_cache_manager is None:
        if cfg.kv_transfer_config is not None and cfg.kv_transfer_config.kv_connector is not None:
            logger.warning(
                "turning off the hybrid KV cache manager: KV connector %s does not support it (only models "
                "with sliding-window or other mixed attention layers lose memory by this)",
                cfg.kv_transfer_config.kv_connector,
            )
            need_disable = True
        sc.disable_hybrid_kv_cache_manager = need_disable
    elif sc.disable_hybrid_kv_cache_manager is False and need_disable:
        raise ValueError(
            "disable_hybrid_kv_cache_manager=False explicitly enables the hybrid KV cache manager, but it "
            "is not supported with this configuration; omit the flag to let the engine decide"
        )


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


def validate_batch_sharded_sampling(cfg: EngineConfig) -> None:
    """P54."""
    pc, mc, spec = cfg.parallel_config, cfg.model_config, cfg.speculative_config
    if not pc.enable_batch_sharded_sampling:
        pc.enable_batch_sharded_sampling = False
        return
    reasons = []
    tp = pc.tensor_parallel_size
    if tp <= 1:
        reasons.append("tensor_parallel_size <= 1 leaves nothing to shard")
    elif (cfg.scheduler_config.max_num_seqs or 0) < tp:
        reasons.append(f"max_num_seqs < tensor_parallel_size ({tp})")
    if mc is not None and mc.max_logprobs < 0:
        reasons.append("max_logprobs < 0")
    if mc is not None and mc.return_sampling_mask:
        reasons.append("return_sampling_mask")
    if spec is not None and spec.enable_adaptive_verification:
        reasons.append("adaptive verification")
    if reasons:
        raise ValueError(f"enable_batch_sharded_sampling is not possible: {'; '.join(reasons)}")


def validate_profiler(cfg: EngineConfig) -> None:
    """P53."""
    prof, cc, mc = cfg.profiler_config, cfg.compilation_config, cfg.model_config
    if prof.profiler != "proton":
        return
    if not _platform().is_cuda():
        raise ValueError("profiler='proton' needs CUDA")
    if prof.proton_graph_attribution and not cfg.use_v2_model_runner:
        raise ValueError("proton_graph_attribution needs the V2 model runner")
    eager = mc is not None and mc.enforce_eager
    graphs = cc.cudagraph_mode not in (None, CUDAGraphMode.NONE) or (cc.cudagraph_mm_encoder and not eager)
    if graphs:
        if prof.proton_mode.split(":", 1)[0].lower() == "pcsampling":
            raise ValueError("proton pcsampling mode needs CUDA graphs disabled (enforce_eager=True)")
        if not prof.proton_graph_attribution:
            raise ValueError(
                "proton with CUDA graphs needs proton_graph_attribution=True or enforce_eager=True"
            )


def validate_adaptive_verification(cfg: EngineConfig) -> None:
    """P55."""
    spec = cfg.speculative_config
    if spec is None or not spec.enable_adaptive_verification:
        return
    if cfg.lora_config is not None:
        raise ValueError("adaptive verification is not supported with LoRA")
    mode = cfg.compilation_config.cudagraph_mode
    if mode is None or not mode.has_full_cudagraphs():
        raise ValueError(
            "adaptive verification needs full CUDA graphs (FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE)"
        )
    if cfg.parallel_config.pipeline_parallel_size > 1:
        raise ValueError("adaptive verification is not supported with pipeline parallelism")


def final_cuda_checks(cfg: EngineConfig, breakable: bool) -> None:
    """P59."""
    cc, mc = cfg.compilation_config, cfg.model_config
    if not _platform().is_cuda_alike():
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


def validate_block_size(cfg: EngineConfig) -> None:
    pc, cc = cfg.parallel_config, cfg.cache_config
    kv = cfg.kv_transfer_config
    if pc.decode_context_parallel_size > 1 and not (kv is not None and kv.has_connector(NIXL_CONNECTOR)):
        interleave = pc.cp_kv_cache_interleave_size
        assert interleave <= cc.block_size and cc.block_size % interleave == 0, (
            f"block_size ({cc.block_size}) must be a multiple of cp_kv_cache_interleave_size ({interleave})"
        )
    if cc.mamba_cache_mode == "align":
        assert not cfg.scheduler_config.disable_chunked_mm_input, (
            "mamba_cache_mode='align' needs disable_chunked_mm_input=False"
        )


def adjust_dcp_kv_cache_interleave_size(cfg: EngineConfig, kv_cache_config: Any) -> None:
    pc = cfg.parallel_config
    if pc.decode_context_parallel_size <= 1:
        return
    if (
        pc.dcp_kv_cache_interleave_size > 1
        and pc.dcp_kv_cache_interleave_size != pc.cp_kv_cache_interleave_size
    ):
        warning_once("cp_kv_cache_interleave_size follows dcp_kv_cache_interleave_size")
        pc.cp_kv_cache_interleave_size = pc.dcp_kv_cache_interleave_size
    kv = cfg.kv_transfer_config
    if kv is not None and kv.has_connector(NIXL_CONNECTOR) and pc._allow_auto_resolve_cp_interleave_size:
        smallest = min(group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups)
        if smallest != pc.cp_kv_cache_interleave_size:
            info_once(f"cp_kv_cache_interleave_size set to the smallest block size {smallest}")
            pc.cp_kv_cache_interleave_size = smallest


def validate_replayssm(cfg: EngineConfig) -> None:
    """After-validator 3 (spec 5.16): ReplaySSM needs a supporting architecture."""
    cc, mc = cfg.cache_config, cfg.model_config
    if not cc.use_replayssm:
        cc.use_kda_recoverssm = False
        return
    arch = mc.architecture if mc is not None else None
    cc.use_kda_recoverssm = cfg.num_speculative_tokens > 0 and arch in (
        "KimiLinearForCausalLM",
        "KimiK3ForConditionalGeneration",
    )
    if mc is None or not mc.supports_replayssm:
        raise ValueError(f"use_replayssm=True but architecture {arch} does not support ReplaySSM")
