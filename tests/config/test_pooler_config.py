"""Runner / convert / pooler_config resolution of pooling models, and the engine settings they imply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import BertConfig, Qwen3Config

from pagedllm.config import EngineConfig
from pagedllm.config.model import ModelConfig
from pagedllm.config.pooler import default_runner, resolve_pooler_config, sentence_transformers_pooling
from pagedllm.config.scheduler import SchedulerConfig


def _bert(path: Path, **extra: object) -> Path:
    BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=64,
        architectures=["BertModel"],
        **extra,
    ).save_pretrained(path)
    return path


def _st_modules(path: Path, modules: list[str], pooling: dict[str, bool]) -> None:
    entries = [
        {
            "idx": i,
            "name": str(i),
            "path": f"{i}_{m}" if m != "Transformer" else "",
            "type": f"sentence_transformers.models.{m}",
        }
        for i, m in enumerate(modules)
    ]
    (path / "modules.json").write_text(json.dumps(entries))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


@pytest.mark.parametrize(
    ("architecture", "runner"),
    [
        ("BertModel", "pooling"),
        ("BertForSequenceClassification", "pooling"),
        ("Qwen3Model", "pooling"),
        ("Qwen3ForCausalLM", "generate"),
        (None, "generate"),
    ],
)
def test_default_runner_by_architecture_name(architecture: str | None, runner: str) -> None:
    assert default_runner(architecture) == runner


def test_encoder_defaults_and_sentence_transformers(tmp_path: Path) -> None:
    path = _bert(tmp_path)
    resolved = resolve_pooler_config("auto", "auto", None, BertConfig.from_pretrained(path), path)
    assert resolved is not None
    assert (resolved["pooling_type"], resolved["normalize"], resolved["encoder"]) == ("CLS", True, True)
    assert resolved["tasks"] == ("embed",)
    _st_modules(path, ["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True})
    resolved = resolve_pooler_config("auto", "auto", None, BertConfig.from_pretrained(path), path)
    # No Normalize module: sentence-transformers does not normalise, and neither do we.
    assert (resolved["pooling_type"], resolved["normalize"]) == ("MEAN", False)
    # The user's pooler_config wins over the checkpoint's.
    resolved = resolve_pooler_config(
        "auto", "auto", {"pooling_type": "LAST"}, BertConfig.from_pretrained(path), path
    )
    assert resolved["pooling_type"] == "LAST"


def test_sentence_transformers_modules_refused_when_not_supported(tmp_path: Path) -> None:
    _st_modules(tmp_path, ["Transformer", "Pooling", "Dense"], {"pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match="Dense"):
        sentence_transformers_pooling(tmp_path)
    _st_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        sentence_transformers_pooling(tmp_path)
    assert sentence_transformers_pooling(tmp_path / "missing") == {}


def test_decoder_as_embedder(tmp_path: Path) -> None:
    config = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    assert resolve_pooler_config("auto", "auto", None, config, tmp_path) is None
    for runner, convert in (("pooling", "auto"), ("auto", "embed")):
        resolved = resolve_pooler_config(runner, convert, None, config, tmp_path)
        assert resolved is not None
        assert (resolved["pooling_type"], resolved["encoder"], resolved["tasks"]) == (
            "LAST",
            False,
            ("embed",),
        )


def test_bad_pooler_configs(tmp_path: Path) -> None:
    path = _bert(tmp_path)
    config = BertConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=r"pooler_config keys \['step_tag_id'\]"):
        resolve_pooler_config("auto", "auto", {"step_tag_id": 3}, config, path)
    with pytest.raises(ValueError, match="pooling_type='MAX'"):
        resolve_pooler_config("auto", "auto", {"pooling_type": "MAX"}, config, path)
    with pytest.raises(ValueError, match="runner='generate'"):
        resolve_pooler_config("generate", "auto", {"normalize": True}, config, path)


def test_pooling_engine_settings(tmp_path: Path) -> None:
    path = _bert(tmp_path, matryoshka_dimensions=[8, 16])
    cfg = EngineConfig(model_config=ModelConfig(model=str(path)), scheduler_config=SchedulerConfig())
    mc, sc = cfg.model_config, cfg.scheduler_config
    assert mc.runner_type == sc.runner_type == "pooling"
    assert mc.pooler_config["matryoshka_dimensions"] == [8, 16]
    # Each prompt in one step, nothing cached across requests.
    assert sc.enable_chunked_prefill is False
    assert cfg.cache_config.enable_prefix_caching is False
    assert sc.max_num_batched_tokens >= mc.max_model_len
    assert sc.async_scheduling is False
