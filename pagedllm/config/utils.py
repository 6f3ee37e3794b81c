"""Helpers shared by every sub-config: the dataclass decorator, hashing, env flags, warn-once."""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from pagedllm import envs

logger = logging.getLogger("pagedllm.config")

# `use_attribute_docstrings` turns the docstring under each field into its description, which
# `pagedllm.config.args` shows as the CLI `--help` text.
CONFIG_DICT = ConfigDict(
    extra="forbid",
    arbitrary_types_allowed=True,
    use_attribute_docstrings=True,
    # Error messages name the field and the problem; the (huge) input repr would only add noise.
    hide_input_in_errors=True,
)

T = TypeVar("T")


def config(cls: type[T]) -> type[T]:
    """Make `cls` a validated pydantic dataclass that rejects unknown fields."""
    return dataclass(config=CONFIG_DICT)(cls)


def safe_hash(data: bytes) -> str:
    """MD5 hex digest (identity, not security), SHA-256 where MD5 is disabled (FIPS builds)."""
    try:
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    except ValueError:
        return hashlib.sha256(data).hexdigest()


def _stable(value: Any) -> Any:
    """A representation of `value` whose str() is identical in every process."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        compute = getattr(value, "compute_hash", None)
        if callable(compute):
            return compute()
        return {f.name: _stable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(str(_stable(v)) for v in value)
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', repr(value))}"
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def hash_fields(obj: Any, names: Iterable[str], extra: Iterable[Any] = ()) -> str:
    """Hash the named attributes of `obj` (the ones that change the compiled graph) plus `extra`."""
    factors: list[Any] = [(name, _stable(getattr(obj, name))) for name in names]
    factors.extend(_stable(value) for value in extra)
    return safe_hash(json.dumps(factors, sort_keys=True, default=str).encode())


def hash_all_fields_except(obj: Any, excluded: Iterable[str]) -> str:
    skip = set(excluded)
    return hash_fields(obj, [f.name for f in dataclasses.fields(obj) if f.name not in skip])


def get_platform() -> Any:
    """The current platform, imported on use: the platforms package itself reads config modules."""
    from pagedllm.platforms import current_platform

    return current_platform


def cache_root() -> Path:
    """Where pagedllm keeps its on-disk caches (compiled graphs, converted tokenizers):
    `$PAGEDLLM_CACHE_ROOT`, else `$XDG_CACHE_HOME/pagedllm`, else `~/.cache/pagedllm`."""
    root = envs.PAGEDLLM_CACHE_ROOT
    if root:
        return Path(root)
    return Path(envs.XDG_CACHE_HOME or Path.home() / ".cache") / "pagedllm"


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@functools.cache
def _info_once(message: str) -> None:
    logger.info(message)


def warning_once(message: str) -> None:
    """Log `message` as a warning once per process."""
    _warn_once(message)


def info_once(message: str) -> None:
    _info_once(message)


def reset_once_caches() -> None:
    """Forget which once-messages were logged (tests assert on them)."""
    _warn_once.cache_clear()
    _info_once.cache_clear()
