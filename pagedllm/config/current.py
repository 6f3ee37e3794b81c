"""The "current config" context: code deep inside model construction (layers choosing kernels) reads
the engine config without it being threaded through every constructor."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.config.compilation import CompilationConfig
    from pagedllm.config.engine import EngineConfig

logger = logging.getLogger("pagedllm.config")

_current_config: EngineConfig | None = None
_current_prefix: str | None = None


class CompilationCounter:
    """Counts models that went through pagedllm compilation (incremented by the compiler wrapper)."""

    def __init__(self) -> None:
        self.num_models_seen = 0


compilation_counter = CompilationCounter()


@functools.lru_cache(maxsize=1)
def get_cached_compilation_config() -> CompilationConfig:
    """The current config's compilation config, memoized (hot path of custom-op dispatch)."""
    return get_current_config().compilation_config


def get_current_config() -> EngineConfig:
    """The config installed by `set_current_config`; a default EngineConfig() outside any context."""
    if _current_config is None:
        from pagedllm.config.engine import EngineConfig

        logger.debug("get_current_config() outside set_current_config(); using a default EngineConfig")
        return EngineConfig()
    return _current_config


def get_current_prefix() -> str | None:
    return _current_prefix


@contextlib.contextmanager
def set_current_config(
    cfg: EngineConfig, check_compile: bool = False, prefix: str | None = None
) -> Iterator[EngineConfig]:
    """Install `cfg` (and a layer-name `prefix`) as current for the block; restores the previous."""
    global _current_config, _current_prefix
    from pagedllm.config.compilation import CompilationMode

    previous, previous_prefix = _current_config, _current_prefix
    seen_before = compilation_counter.num_models_seen
    get_cached_compilation_config.cache_clear()
    _current_config, _current_prefix = cfg, prefix
    try:
        yield cfg
        if check_compile:
            cfg.compilation_config.custom_op_log_check()
            if (
                cfg.compilation_config.mode == CompilationMode.VLLM_COMPILE
                and compilation_counter.num_models_seen == seen_before
            ):
                model = cfg.model_config.model if cfg.model_config is not None else None
                logger.warning(
                    "torch.compile is turned on, but model %s does not support it; it runs uncompiled", model
                )
    finally:
        _current_config, _current_prefix = previous, previous_prefix
        get_cached_compilation_config.cache_clear()


def get_layers_from_config(
    cfg: EngineConfig, layer_type: type[Any], layer_names: list[str] | None = None
) -> dict[str, Any]:
    """Layers of `layer_type` registered in the static forward context, by name (missing: skipped)."""
    context = cfg.compilation_config.static_forward_context
    names = list(context) if layer_names is None else layer_names
    return {
        name: context[name] for name in names if name in context and isinstance(context[name], layer_type)
    }
