"""The EngineCore's operations outside the request path: sleep mode, weight updates, profiling and
named worker calls (`collective_rpc`). Front-ends reach them through `call_utility` (see
`pagedllm.engine.utility`); each runs between two steps.

Sleep and weight updates need an idle engine (no unfinished request): a request half computed with
released KV blocks, or with the old weights for its prompt and the new ones for its output, would be
wrong without an error. The engine core process defers a weight update that meets unfinished requests:
the running ones finish on the old weights while the scheduler holds the waiting and new ones
(`hold_waiting`), which then start on the new weights (like vLLM, a request preempted before the update
resumes on them). While the engine sleeps it refuses new requests (`EngineSleepingError`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.config.sleep_mode import check_sleep_level, check_wake_tags
from pagedllm.engine.utility import (
    DRAINING_METHODS,
    EngineSleepingError,
    check_rpc_method,
    check_utility_method,
)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.executor import Executor

logger = logging.getLogger("pagedllm.engine")


def check_arguments(
    function: Callable[..., Any], name: str, args: Sequence[Any], kwargs: dict[str, Any] | None
) -> None:
    """ValueError naming ``name`` unless ``function`` takes these arguments (a caller's mistake, not a
    failure of the engine)."""
    try:
        inspect.signature(function).bind(*args, **(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"{name}: {e}") from None


class EngineCoreOps:
    """Mixed into EngineCore (which provides the executor, the scheduler and the request counts)."""

    model_executor: Executor
    scheduler: Scheduler
    engine_config: EngineConfig
    # The parts a sleeping engine released (empty while awake).
    _asleep: set[str]

    def call_utility(
        self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run the utility `method` (one of `UTILITY_METHODS`) with its arguments."""
        call = getattr(self, check_utility_method(method))
        check_arguments(call, method, args, kwargs)
        return call(*args, **(kwargs or {}))

    def _require_idle(self, what: str, held_ok: bool = False) -> None:
        """Raise unless no request is unfinished (`held_ok`: none is running, and the scheduler holds
        the waiting ones: they start after `what`)."""
        scheduler = self.scheduler
        held = held_ok and scheduler.hold_waiting
        n = len(scheduler.running) if held else scheduler.get_num_unfinished_requests()
        if n:
            raise ValueError(
                f"{what} needs an idle engine: {n} requests are unfinished (wait for them or abort them)"
            )

    def defers(self, method: str) -> bool:
        """Whether `method` must wait for the running requests: a weight update on a busy engine. The
        scheduler then holds the waiting and new requests (they start on the new weights) until the
        caller ran it, once no request is running, and called `release_held_requests`."""
        if method in DRAINING_METHODS and self.scheduler.has_unfinished_requests():
            self.scheduler.hold_waiting = True
            return True
        return False

    def release_held_requests(self) -> None:
        self.scheduler.hold_waiting = False

    def check_awake(self) -> None:
        if self._asleep:
            raise EngineSleepingError()

    # ------------------------------------------------------------------------------------- sleep
    def sleep(self, level: int = 1) -> int:
        """Release the KV cache (level 1) and the weights (level 2); returns the bytes released."""
        if not self.engine_config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is not enabled (enable_sleep_mode=True, or --enable-sleep-mode)")
        level = check_sleep_level(level)
        if self._asleep:
            raise ValueError("the engine is already sleeping")
        self._require_idle("sleep")
        # The released blocks' contents are gone: no later request may hit them.
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset before sleeping")
        released = sum(self.model_executor.collective_rpc("sleep", args=(level,)))
        self._asleep = {"kv_cache", "weights"}
        return int(released)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: all of it, or the parts named by `tags` ("weights", "kv_cache")."""
        wanted = check_wake_tags(tags)
        self.model_executor.collective_rpc("wake_up", args=(list(wanted),))
        self._asleep -= set(wanted)

    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    # ----------------------------------------------------------------------------------- workers
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call a worker method by name (or, in-process, a function of the worker) on every worker."""
        if not callable(method):
            method = check_rpc_method(method)
            # Checked here against the worker class: in a worker process the mismatch would come back
            # as that worker's failure (a server error) rather than the caller's.
            worker_method = self.model_executor.worker_method(method)
            if worker_method is None:
                raise ValueError(f"collective_rpc: the worker has no method {method!r}")
            check_arguments(worker_method, f"collective_rpc {method!r}", (None, *args), kwargs)
        return self.model_executor.collective_rpc(method, tuple(args), kwargs, timeout)

    def start_profile(self) -> None:
        self.model_executor.collective_rpc("start_profile")

    def stop_profile(self) -> list[str]:
        """Stop the profiler; the trace files written (one per worker)."""
        return list(self.model_executor.collective_rpc("stop_profile"))

    # ----------------------------------------------------------------------------- weight updates
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's weight transfer group (`weight_transfer_config`)."""
        self.model_executor.collective_rpc("init_weight_transfer_engine", args=(init_info,))

    def update_weights(self, update_info: dict[str, Any]) -> int:
        """Receive the weights a trainer pushes (names, dtype_names, shapes in `update_info`)."""
        return self._update("update_weights", update_info)

    def update_weights_from_disk(self, path: str) -> int:
        """Load the weights of the safetensors checkpoint at `path` into the running model."""
        return self._update("update_weights_from_disk", str(path))

    def _update(self, method: str, arg: Any) -> int:
        if "weights" in self._asleep:
            # Level 2 released them: wake them first (then this update replaces what was reloaded).
            raise ValueError("the weights are asleep: call wake_up(tags=['weights']) before a weight update")
        self._require_idle("a weight update", held_ok=True)
        loaded = self.model_executor.collective_rpc(method, args=(arg,))[0]
        if not self.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset after the weight update")
        return int(loaded)
