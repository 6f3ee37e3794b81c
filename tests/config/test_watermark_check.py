"""Spec 6.9: the watermark support check."""

from __future__ import annotations

import logging

import pytest

from pagedllm.config import EngineConfig, ModelConfig, SpeculativeConfig, WatermarkConfig
from pagedllm.config.support import allow_unsupported
from pagedllm.config.watermark_check import check_supports_watermarking
from pagedllm.sampling_params import SamplingParams


class WatermarkedParams(SamplingParams, kw_only=True):
    """SamplingParams with the trace-replay field the check reads."""

    trace_decode_token_ids: list[int] | None = None


class BeamSearchParams:
    pass


def _cfg(watermark: bool = True, speculative: SpeculativeConfig | None = None) -> EngineConfig:
    with allow_unsupported():
        return EngineConfig(
            model_config=ModelConfig(),
            watermark_config=WatermarkConfig() if watermark else None,
            speculative_config=speculative,
        )


def test_no_watermark_config(caplog: pytest.LogCaptureFixture) -> None:
    cfg = _cfg(watermark=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        assert check_supports_watermarking(cfg, WatermarkedParams(watermarking=None)) is False
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        assert check_supports_watermarking(cfg, WatermarkedParams(watermarking=True)) is False
    assert "not watermarked" in caplog.text
    assert check_supports_watermarking(cfg) is False


def test_watermark_without_spec(caplog: pytest.LogCaptureFixture, triton_installed: None) -> None:
    cfg = _cfg()
    assert cfg.use_v2_model_runner is True
    assert check_supports_watermarking(cfg) is True
    assert check_supports_watermarking(cfg, WatermarkedParams(temperature=0.7)) is True
    assert check_supports_watermarking(cfg, WatermarkedParams(temperature=0.7, watermarking=False)) is False
    with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
        assert check_supports_watermarking(cfg, WatermarkedParams(temperature=0.0)) is False
        assert check_supports_watermarking(cfg, BeamSearchParams()) is False
        traced = WatermarkedParams(temperature=0.7, trace_decode_token_ids=[1])
        assert check_supports_watermarking(cfg, traced) is False
    assert "greedy" in caplog.text and "beam search" in caplog.text and "traced" in caplog.text
    with pytest.raises(TypeError, match="dict"):
        check_supports_watermarking(cfg, {"temperature": 1.0})
    with pytest.raises(ValueError, match="model-specific samplers"):
        check_supports_watermarking(cfg, custom_sampler=True)


@pytest.mark.parametrize(
    ("speculative", "message"),
    [
        (
            SpeculativeConfig(method="eagle3", num_speculative_tokens=2, draft_sample_method="greedy"),
            "probabilistic",
        ),
        (SpeculativeConfig(method="ngram", num_speculative_tokens=2), "autoregressive"),
        (
            SpeculativeConfig(method="eagle3", num_speculative_tokens=2, parallel_drafting=True),
            "parallel drafting",
        ),
    ],
)
def test_watermark_with_bad_spec(speculative: SpeculativeConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(speculative=speculative)


def test_watermark_with_dspark_parallel_drafting(triton_installed: None) -> None:
    cfg = _cfg(
        speculative=SpeculativeConfig(method="dspark", num_speculative_tokens=2, parallel_drafting=True)
    )
    assert check_supports_watermarking(cfg) is True


def test_watermark_spec_rules_beyond_the_spec_examples(
    caplog: pytest.LogCaptureFixture, triton_installed: None
) -> None:
    eagle3 = dict(method="eagle3", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="rejection_sample_method='standard'"):
        _cfg(speculative=SpeculativeConfig(**eagle3, rejection_sample_method="strict"))
    with allow_unsupported():
        with pytest.raises(
            ValueError, match="'kgw' does not support speculative decoding.*allow_target_only"
        ):
            EngineConfig(
                model_config=ModelConfig(),
                watermark_config=WatermarkConfig(algorithm="kgw"),
                speculative_config=SpeculativeConfig(**eagle3),
            )
        with caplog.at_level(logging.WARNING, logger="pagedllm.config"):
            EngineConfig(
                model_config=ModelConfig(),
                watermark_config=WatermarkConfig(algorithm="kgw", allow_target_only_watermarking=True),
                speculative_config=SpeculativeConfig(**eagle3),
            )
            EngineConfig(
                model_config=ModelConfig(),
                watermark_config=WatermarkConfig(algorithm="dual_key_gumbel", alpha=0.9),
                speculative_config=SpeculativeConfig(**eagle3),
            )
    assert "target tokens only" in caplog.text
    assert "alpha is unused under speculative decoding" in caplog.text
