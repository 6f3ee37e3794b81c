"""The server's check of a request's constraint: off the event loop, within a time budget.

Checking a constraint means converting it with the grammar engine (`resolve_backend`), which may take
seconds and cannot be interrupted; on the event loop it stalled every request and `/health` (16 s for
a 90-byte schema). Here the limits (`limits.py`, linear in the constraint's size) are checked on the
loop, and the conversion runs in a thread of its own (not the default executor's, which tokenizes
prompts: a slow constraint must not hold those up), at most two at a time, for at most
`validation_timeout_s` including the wait for a turn; a constraint not checked in time is refused. A
conversion still running after its budget keeps its turn until it ends (so abandoned conversions
never pile up; the limits bound how long that is), in a daemon thread (the process never waits for it
to exit).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.structured_output.backends import apply_switches, resolve_backend
from pagedllm.structured_output.limits import check_limits
from pagedllm.structured_output.params import StructuredOutputsParams


class ConstraintChecker:
    def __init__(self, config: Any, max_threads: int = 2) -> None:
        """``config``: the engine's StructuredOutputsConfig."""
        self.config = config
        self._turns = asyncio.Semaphore(max_threads)

    async def check(self, params: StructuredOutputsParams) -> None:
        """Check ``params`` and resolve its backend (in place), as `apply_engine_config` does;
        RequestError naming the field for a bad constraint or one not checked within the budget."""
        config = self.config
        check_limits(params, config)
        apply_switches(params, config)
        try:
            params.resolved_backend = await asyncio.wait_for(
                self._convert(params), config.validation_timeout_s
            )
        except TimeoutError:
            raise RequestError(
                "structured_outputs",
                f"structured_outputs.{params.kind} could not be checked within {config.validation_timeout_s:g} s "
                "(structured_outputs_config.validation_timeout_s): simplify the constraint"
            ) from None

    async def _convert(self, params: StructuredOutputsParams) -> str:
        loop = asyncio.get_running_loop()
        await self._turns.acquire()
        answer: asyncio.Future[str] = loop.create_future()

        def finish(backend: str | None, error: BaseException | None) -> None:
            self._turns.release()
            if answer.done():  # over its budget: nobody waits for it any more
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(backend)  # type: ignore[arg-type]

        def convert() -> None:
            backend, error = None, None
            try:
                backend = resolve_backend(params, self.config.backend, self.config.disable_fallback)
            except BaseException as e:  # handed to the request
                error = e
            try:
                loop.call_soon_threadsafe(finish, backend, error)
            except RuntimeError:  # the loop is closed: the server has stopped
                pass

        try:
            threading.Thread(target=convert, name="pagedllm-constraint", daemon=True).start()
        except BaseException:
            self._turns.release()
            raise
        return await answer
