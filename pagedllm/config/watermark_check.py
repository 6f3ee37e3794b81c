"""Whether a request is watermarked (spec 5.17); raises for speculative settings no watermark covers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.config.utils import warning_once

if TYPE_CHECKING:
    from pagedllm.config.engine import EngineConfig

_WATERMARKABLE_SPEC_METHODS = ("dspark", "eagle", "eagle3", "mtp")


def check_supports_watermarking(cfg: EngineConfig, request: Any = None, custom_sampler: bool = False) -> bool:
    wm, spec = cfg.watermark_config, cfg.speculative_config
    if wm is None:
        if request is not None and getattr(request, "watermarking", None) is True:
            warning_once(
                "a request asked for watermarking but no watermark_config is set; it is not watermarked"
            )
        return False
    if spec is not None:
        if spec.draft_sample_method != "probabilistic":
            raise ValueError("watermarking needs speculative_config.draft_sample_method='probabilistic'")
        if spec.rejection_sample_method != "standard":
            raise ValueError("watermarking needs speculative_config.rejection_sample_method='standard'")
        if spec.parallel_drafting and spec.method != "dspark":
            raise ValueError(f"watermarking does not support parallel drafting with method {spec.method!r}")
        if spec.method not in _WATERMARKABLE_SPEC_METHODS:
            raise ValueError(
                f"watermarking supports only autoregressive model-based speculative decoding "
                f"({', '.join(_WATERMARKABLE_SPEC_METHODS)}), not {spec.method!r}"
            )
        if not wm.supports_speculative_decoding:
            if not wm.allow_target_only_watermarking:
                raise ValueError(
                    f"watermark algorithm {wm.algorithm!r} does not support speculative decoding; set "
                    "watermark_config.allow_target_only_watermarking=True to watermark target tokens only"
                )
            warning_once(f"watermark {wm.algorithm!r} covers target tokens only: weaker detectability")
        if wm.algorithm == "dual_key_gumbel" and wm.alpha != wm.default_alpha():
            warning_once("watermark_config.alpha is unused under speculative decoding")
    if custom_sampler:
        raise ValueError("watermarking is not supported with model-specific samplers")
    if request is None:
        return True
    if getattr(request, "watermarking", None) is False:
        return False
    from pagedllm.sampling_params import SamplingParams

    if type(request).__name__ == "BeamSearchParams":
        warning_once("beam search requests are not watermarked")
        return False
    if not isinstance(request, SamplingParams):
        raise TypeError(f"watermarking check expects SamplingParams, got {type(request).__name__}")
    if getattr(request, "trace_decode_token_ids", None) is not None:
        warning_once("requests replaying traced decode tokens are not watermarked")
        return False
    if request.temperature == 0:
        warning_once("greedy requests (temperature=0) are not watermarked")
        return False
    return True
