"""Sleep mode's levels and tags (`model_config.enable_sleep_mode`) and their checks: run by the engine
before it releases anything and by each worker (`pagedllm.worker.sleep`), which may be called directly."""

from __future__ import annotations

from collections.abc import Sequence

SLEEP_LEVELS = (1, 2)
# What a sleeping engine released and `wake_up(tags=...)` restores.
SLEEP_TAGS = ("weights", "kv_cache")


def check_sleep_level(level: int) -> int:
    if level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level must be 1 (discard the KV cache) or 2 (and the weights), not {level!r}"
        )
    return int(level)


def check_wake_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The parts to wake (all when None); ValueError naming an unknown tag."""
    if tags is None:
        return SLEEP_TAGS
    if isinstance(tags, str):
        tags = [tags]
    unknown = sorted(set(tags) - set(SLEEP_TAGS))
    if unknown:
        raise ValueError(f"unknown wake_up tags {unknown} (known: {', '.join(SLEEP_TAGS)})")
    return tuple(t for t in SLEEP_TAGS if t in tags)
