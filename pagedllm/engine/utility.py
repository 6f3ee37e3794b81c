"""Engine operations outside the request path (sleep mode, weight updates, profiling, worker RPCs):
their names, argument checks and errors, shared by the in-process and the ZMQ front-ends.

The front-ends reach them through one "utility call" (`EngineCore.call_utility`): a method name from
`UTILITY_METHODS` with its arguments, run by the core between two steps, so new requests wait in the
input queue while it runs (a weight update never meets a half-done step).
"""

from __future__ import annotations

from collections.abc import Sequence

SLEEP_LEVELS = (1, 2)
# What a sleeping engine released and `wake_up(tags=...)` restores.
SLEEP_TAGS = ("weights", "kv_cache")

# Utilities that, on a busy engine, wait for the running requests to finish while the waiting and new
# ones are held (`EngineCoreOps.defers`; the engine core process does it, in-process callers get
# "needs an idle engine").
DRAINING_METHODS = frozenset({"update_weights", "update_weights_from_disk"})

# The EngineCore methods a front-end may call by name.
UTILITY_METHODS = frozenset(
    {
        "sleep",
        "wake_up",
        "is_sleeping",
        "reset_prefix_cache",
        "collective_rpc",
        "start_profile",
        "stop_profile",
        "init_weight_transfer_engine",
        "update_weights",
        "update_weights_from_disk",
        "add_lora",
        "remove_lora",
        "list_loras",
    }
)


class EngineSleepingError(RuntimeError):
    """A request reached an engine in sleep mode: it serves nothing until `wake_up()`."""

    def __init__(self) -> None:
        super().__init__("The engine is sleeping (sleep mode): call wake_up() before sending requests")


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


def check_utility_method(method: str) -> str:
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown engine utility {method!r} (known: {', '.join(sorted(UTILITY_METHODS))})")
    return method


def check_rpc_method(method: str) -> str:
    """A worker method a caller may name in `collective_rpc` (public ones only)."""
    if not isinstance(method, str) or not method.isidentifier() or method.startswith("_"):
        raise ValueError(f"collective_rpc method must be the name of a public worker method, not {method!r}")
    return method
