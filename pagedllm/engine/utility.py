"""Engine operations outside the request path (sleep mode, weight updates, profiling, worker RPCs):
their names, argument checks and errors, shared by the in-process and the ZMQ front-ends (the
workers' side of sleep mode is `pagedllm.worker.sleep`).

The front-ends reach them through one "utility call" (`EngineCore.call_utility`): a method name from
`UTILITY_METHODS` with its arguments, run by the core between two steps, so new requests wait in the
input queue while it runs (a weight update never meets a half-done step).
"""

from __future__ import annotations

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


def check_utility_method(method: str) -> str:
    if method not in UTILITY_METHODS:
        raise ValueError(f"unknown engine utility {method!r} (known: {', '.join(sorted(UTILITY_METHODS))})")
    return method


def check_rpc_method(method: str) -> str:
    """A worker method a caller may name in `collective_rpc` (public ones only)."""
    if not isinstance(method, str) or not method.isidentifier() or method.startswith("_"):
        raise ValueError(f"collective_rpc method must be the name of a public worker method, not {method!r}")
    return method
