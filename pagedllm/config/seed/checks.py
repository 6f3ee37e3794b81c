"""The upstream-mirror validators: the construction steps with their own rules (spec 5.5 and the P5x
validations) and the after-validators of EngineConfig, for the hybrid KV cache manager, the proton
profiler, batch-sharded sampling, adaptive verification, decode context parallelism, MLA and Mamba.
pagedllm runs none of these features; `construct` and `EngineConfig` call them in the spec's order."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.config.compilation import CUDAGraphMode
from pagedllm.config.utils import get_platform, info_once, warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

NIXL_CONNECTOR = "NixlConnector"


def resolve_hybrid_kv_cache_manager(cfg: EngineConfig) -> None:
    """P66 / spec 5.5."""
    sc, mc, spec = cfg.scheduler_config, cfg.model_config, cfg.speculative_config
    need_disable = not get_platform().support_hybrid_kv_cache()
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
    if not get_platform().is_cuda():
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


def validate_nvfp4_kv_cache_with_mla(cfg: EngineConfig) -> None:
    """After-validator 1."""
    mc, dtype = cfg.model_config, cfg.cache_config.cache_dtype
    if mc is not None and dtype.startswith("nvfp4") and not dtype.endswith("_ds_mla") and mc.use_mla:
        raise ValueError(
            f"cache_dtype={dtype!r} is not supported with MLA models; use 'fp8', 'auto' or 'nvfp4_ds_mla'"
        )


def validate_mamba_block_size(cfg: EngineConfig) -> None:
    """After-validator 2."""
    mc, cc = cfg.model_config, cfg.cache_config
    if mc is None:
        return
    if (
        cc.mamba_block_size is not None
        and cc.mamba_block_size != mc.max_model_len
        and not cc.enable_prefix_caching
    ):
        raise ValueError("mamba_block_size can only be set together with enable_prefix_caching=True")
