"""Runner and pooler resolution of pooling models (embedding encoders, decoders used as embedders,
cross-encoders), as vLLM's `--runner` / `--convert` / `--pooler-config` do it.

The resolved pooler config is a plain dict (it is hashed by repr and travels to the workers):
`pooling_type` (CLS / MEAN / LAST), `normalize`, `use_activation`, `tasks` (what requests may ask),
`matryoshka_dimensions` (None: any size up to the hidden size) and `encoder` (bidirectional attention:
each prompt must be computed in one step)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.config.utils import info_once

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

POOLING_TYPES = ("CLS", "MEAN", "LAST")
# Encoders (bidirectional attention) by architecture; their classifier variants serve classify/score.
_ENCODER_ARCHS = {"BertModel": ("embed",), "BertForSequenceClassification": ("classify", "score")}
# pooler_config keys a user may set (vLLM's names).
_USER_KEYS = ("pooling_type", "normalize", "use_activation", "dimensions")
# sentence-transformers' Pooling module flags -> pooling type.
_ST_POOLING_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}


def default_runner(architecture: str | None) -> str:
    """vLLM's rule: an architecture named like a pooling model runs the pooling runner."""
    if architecture is None:
        return "generate"
    if architecture in _ENCODER_ARCHS or architecture.endswith(("Model", "ForSequenceClassification")):
        return "pooling"
    return "generate"


def sentence_transformers_pooling(model_path: Path) -> dict[str, Any]:
    """Pooling type and normalisation from a sentence-transformers checkpoint (`modules.json` and its
    Pooling module's config); {} when the model is not one."""
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Normalize":
            found["normalize"] = True
        elif kind == "Pooling":
            config_file = model_path / module.get("path", "") / "config.json"
            pooling = json.loads(config_file.read_text()) if config_file.is_file() else {}
            modes = [name for key, name in _ST_POOLING_MODES.items() if pooling.get(key)]
            other = sorted(
                k
                for k, v in pooling.items()
                if k.startswith("pooling_mode") and v and k not in _ST_POOLING_MODES
            )
            if other or len(modes) > 1:
                raise ValueError(
                    f"{config_file}: pooling modes {other or modes} are not supported (one of CLS, MEAN, LAST)"
                )
            if modes:
                found["pooling_type"] = modes[0]
        elif kind not in ("Transformer", "Normalize"):
            raise ValueError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not supported"
            )
    return found


def resolve_pooler_config(
    runner: str,
    convert: str,
    user: dict[str, Any] | None,
    hf_config: PretrainedConfig,
    model_path: Path,
) -> dict[str, Any] | None:
    """The resolved pooler config of a pooling model; None for a generative one."""
    if user is not None and "tasks" in user:
        return user  # already resolved (a copy of a constructed ModelConfig)
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    if runner == "auto":
        runner = (
            "pooling"
            if (user is not None or convert in ("embed", "classify"))
            else default_runner(architecture)
        )
    if runner != "pooling":
        if user is not None:
            raise ValueError(f"pooler_config is set but runner={runner!r} (pooling models only)")
        return None
    unknown = sorted(set(user or {}) - set(_USER_KEYS))
    if unknown:
        raise ValueError(
            f"pooler_config keys {unknown} are not supported (supported: {', '.join(_USER_KEYS)})"
        )
    encoder_tasks = _ENCODER_ARCHS.get(architecture or "")
    if encoder_tasks is None and convert == "classify":
        raise ValueError(
            f"convert='classify' is not supported for {architecture} (only BertForSequenceClassification)"
        )
    tasks = encoder_tasks or ("embed",)
    resolved: dict[str, Any] = {
        # vLLM's defaults: encoders pool the CLS token, decoders used as embedders their last token.
        "pooling_type": "CLS" if encoder_tasks is not None else "LAST",
        "normalize": True,
        "use_activation": True,
        "dimensions": None,
        **sentence_transformers_pooling(model_path),
        **(user or {}),
        "tasks": tasks,
        "matryoshka_dimensions": getattr(hf_config, "matryoshka_dimensions", None),
        "encoder": encoder_tasks is not None,
    }
    if resolved["pooling_type"] not in POOLING_TYPES:
        raise ValueError(
            f"pooler_config.pooling_type={resolved['pooling_type']!r} (supported: {', '.join(POOLING_TYPES)})"
        )
    return resolved


def apply_pooling_defaults(cfg: EngineConfig) -> None:
    """Part of the per-model hook (P06): a pooling model runs the pooling runner, and every prompt is
    pooled in one step: no chunked prefill (the pooler needs every token's hidden state at once, and an
    encoder's attention the whole prompt) and no prefix caching (a prefix hit would skip tokens the
    pooler reads)."""
    mc, sc = cfg.model_config, cfg.scheduler_config
    if mc is None:
        return
    sc.runner_type = mc.runner_type
    if mc.runner_type != "pooling":
        return
    info_once("pooling model: each prompt runs in one step (chunked prefill and prefix caching are off)")
    sc.enable_chunked_prefill = False
    cfg.cache_config.enable_prefix_caching = False
    if sc.max_num_batched_tokens_defaulted:
        assert sc.max_num_batched_tokens is not None
        sc.max_num_batched_tokens = max(sc.max_num_batched_tokens, mc.max_model_len)
