"""Model-runner generation selection (spec 5.9). pagedllm has a single model runner; the "V1"/"V2"
distinction of the spec survives as the feature sets each runner generation supports, which decide
properties such as `max_concurrent_batches`, and the errors for combinations neither supports."""

from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING

from pagedllm import envs
from pagedllm.config.utils import info_once, warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

_V2_UNSUPPORTED_METHODS = ("suffix", "medusa", "mlp_speculator", "custom_class")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def dbo_unsupported_features(cfg: EngineConfig) -> list[str]:
    pc, mc = cfg.parallel_config, cfg.model_config
    found = []
    if cfg.lora_config is not None:
        found.append("LoRA")
    if cfg.speculative_config is not None:
        found.append("speculative decoding")
    if pc.pipeline_parallel_size > 1:
        found.append("pipeline parallelism")
    if pc.decode_context_parallel_size > 1 or pc.prefill_context_parallel_size > 1:
        found.append("context parallelism")
    if mc is not None and (mc.is_multimodal_model or mc.is_encoder_decoder):
        found.append("multimodal or encoder-decoder model")
    if mc is not None and mc.is_hybrid:
        found.append("hybrid model")
    from pagedllm.config.compilation import CUDAGraphMode

    if cfg.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE:
        found.append("PIECEWISE cudagraph mode")
    if cfg.is_mm_encoder_only:
        found.append("encoder-only instance")
    return found


def v2_unsupported_features(cfg: EngineConfig) -> list[str]:
    pc, spec = cfg.parallel_config, cfg.speculative_config
    found = []
    if pc.distributed_executor_backend == "external_launcher" and pc.pipeline_parallel_size > 1:
        found.append("external_launcher with pipeline parallelism")
    if spec is not None:
        if spec.method in _V2_UNSUPPORTED_METHODS:
            found.append(f"speculative method {spec.method}")
        if spec.parallel_drafting and spec.method not in ("dflash", "dspark"):
            found.append(f"parallel drafting with {spec.method}")
        if spec.use_heterogeneous_vocab:
            found.append("heterogeneous-vocabulary draft model")
    if pc.use_ubatching:
        if envs.PAGEDLLM_USE_V2_MODEL_RUNNER is None:
            found.append("dual batch overlap")
        else:
            found.extend(f"dual batch overlap with {f}" for f in dbo_unsupported_features(cfg))
    return found


def v1_unsupported_features(cfg: EngineConfig) -> list[str]:
    pc, spec, mc = cfg.parallel_config, cfg.speculative_config, cfg.model_config
    found = []
    if pc.prefill_context_parallel_size > 1:
        found.append("prefill context parallelism")
    if pc.pipeline_parallel_size > 1 and cfg.scheduler_config.async_scheduling:
        found.append("pipeline parallelism with async scheduling")
    if spec is not None:
        if spec.use_dspark():
            found.append("dspark speculative decoding")
        if spec.enable_adaptive_verification:
            found.append("adaptive verification")
        draft = getattr(spec.draft_model_config, "hf_config", None)
        if spec.use_dflash() and draft is not None:
            layer_types = list(getattr(draft, "layer_types", None) or [])
            sliding = sum(1 for t in layer_types if t == "sliding_attention")
            if 0 < sliding < len(layer_types):
                found.append("DFlash draft mixing sliding and full attention")
            if set(getattr(draft, "architectures", None) or []) & {"DFlash2DraftModel", "LiLiCorrDraftModel"}:
                found.append("DFlash candidate-head draft")
    if mc is not None and mc.is_diffusion:
        found.append("diffusion model")
    if pc.enable_batch_sharded_sampling:
        found.append("batch-sharded sampling")
    return found


def _v2_forced_by(cfg: EngineConfig) -> str:
    """Names the field that forced the V2 runner, so a missing Triton points at the user's setting."""
    if cfg.attention_config.hisparse_config is not None:
        return " (forced by attention_config.hisparse_config)"
    if cfg.watermark_config is not None:
        return " (forced by watermark_config)"
    return ""


def select_v2_model_runner(cfg: EngineConfig) -> bool:
    flag = envs.PAGEDLLM_USE_V2_MODEL_RUNNER
    if cfg.attention_config.hisparse_config is not None:
        if flag is False:
            raise ValueError("HiSparse needs the V2 model runner but PAGEDLLM_USE_V2_MODEL_RUNNER=0")
        return True
    if cfg.watermark_config is not None:
        if flag is False:
            info_once("watermarking forces the V2 model runner despite PAGEDLLM_USE_V2_MODEL_RUNNER=0")
        return True
    if flag is not None:
        return flag
    if not triton_available():
        from pagedllm.platforms import current_platform

        # Without a GPU there is no Triton by design; only a CUDA machine lacking it is worth a warning.
        if current_platform.is_cuda_alike():
            warning_once("Triton is not available; using the V1 model runner")
        else:
            logger.debug(
                "Triton is not available on %s; using the V1 model runner", current_platform.device_type
            )
        return False
    unsupported = v2_unsupported_features(cfg)
    if unsupported:
        warning_once(f"V2 model runner does not support {', '.join(unsupported)}; using V1")
        return False
    return True


def validate_model_runner(cfg: EngineConfig) -> None:
    """Step P52: the selected runner generation must support every enabled feature."""
    from pagedllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = cfg.compilation_config
    if cfg.use_v2_model_runner:
        if cc.mode == CompilationMode.STOCK_TORCH_COMPILE and cc.cudagraph_mode != CUDAGraphMode.NONE:
            info_once("CUDA graphs are disabled with stock torch.compile on the V2 model runner")
            cc.cudagraph_mode = CUDAGraphMode.NONE
            cc.max_cudagraph_capture_size = 0
            cc.cudagraph_capture_sizes = []
        if not triton_available():
            raise ValueError(f"the V2 model runner{_v2_forced_by(cfg)} needs Triton, which is not installed")
        unsupported = v2_unsupported_features(cfg)
        if unsupported:
            raise ValueError(f"the V2 model runner does not support: {', '.join(unsupported)}")
    else:
        unsupported = v1_unsupported_features(cfg)
        if unsupported:
            raise ValueError(f"the V1 model runner does not support: {', '.join(unsupported)}")
