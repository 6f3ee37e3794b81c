"""The server's check of a request's constraint: in a process that is killed at the check's deadline.

Checking a constraint means converting it with the grammar engine (`resolve_backend`), which may take
minutes and cannot be interrupted: on the event loop it stalled every request and `/health`, and in a
thread it kept a core of the API server busy for as long as it ran (no thread can be stopped). Here the
limits (`limits.py`, linear in the constraint's size) are checked on the loop, and the conversion runs
in a worker of the API server's own grammar compile server (`compile_client.py`, started with the first
constraint; its start counts against no budget), at most one check per worker, for at most
`validation_timeout_s` including the wait for a worker; a worker whose check is not done by then is
killed, so nothing of the check goes on, and the constraint is refused (400 naming the field and the
setting). The loop never blocks: it waits for the server's answer on a future.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any

from pagedllm.errors import RequestError
from pagedllm.structured_output.backends import apply_switches
from pagedllm.structured_output.compile_client import (
    GRACE_S,
    START_TIMEOUT_S,
    CompileClient,
    CompileWorkerError,
    outcome,
)
from pagedllm.structured_output.compile_server import Job, Result
from pagedllm.structured_output.limits import check_limits
from pagedllm.structured_output.params import StructuredOutputsParams

# How often the loop looks whether the compile server has started (only while it starts: seconds).
_START_POLL_S = 0.05


class ConstraintChecker:
    def __init__(self, config: Any, max_workers: int = 2) -> None:
        """``config``: the engine's StructuredOutputsConfig."""
        self.config = config
        self._turns = asyncio.Semaphore(max_workers)
        self._client = CompileClient(max_workers, config.compile_memory_mb())

    async def check(self, params: StructuredOutputsParams) -> None:
        """Check ``params`` and resolve its backend (in place), as `apply_engine_config` does;
        RequestError naming the field for a bad constraint or one not checked within the budget."""
        config = self.config
        check_limits(params, config)
        apply_switches(params, config)
        try:
            result = await self._run(params)
        except CompileWorkerError as e:
            raise RequestError(
                "structured_outputs", f"structured_outputs.{params.kind} could not be checked: {e}"
            ) from e
        params.resolved_backend = outcome(
            result,
            f"structured_outputs.{params.kind} could not be checked within {config.validation_timeout_s:g} s "
            "(structured_outputs_config.validation_timeout_s): simplify the constraint",
        )[0]

    async def _run(self, params: StructuredOutputsParams) -> Result:
        """The compile server's answer to a check of ``params`` (a "timeout" result when the budget ran
        out waiting for a worker)."""
        config = self.config
        loop = asyncio.get_running_loop()
        # Started on the loop's thread, which lives as long as the server: the compile server dies with
        # the thread that started it.
        server = self._client.spawn()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.ready.is_set():
            if time.monotonic() > deadline:
                raise CompileWorkerError(f"the grammar compile server did not start in {START_TIMEOUT_S:g} s")
            await asyncio.sleep(_START_POLL_S)
        budget = config.validation_timeout_s
        started = time.monotonic()
        try:
            await asyncio.wait_for(self._turns.acquire(), budget)
        except TimeoutError:
            return Result(0, "timeout")
        left = budget - (time.monotonic() - started)
        if left <= 0:
            self._turns.release()
            return Result(0, "timeout")
        job = Job(0, params, config.backend, config.disable_fallback, left, check_only=True)
        try:
            future = server.send(job)
        except BaseException:
            self._turns.release()
            raise
        assert future is not None

        def release(_: Future[Result]) -> None:
            # The worker is free once the server answers (or dies), whether or not the request still waits.
            try:
                loop.call_soon_threadsafe(self._turns.release)
            except RuntimeError:  # the loop is closed: the server has stopped
                pass

        future.add_done_callback(release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), left + GRACE_S)
        except TimeoutError:
            server.mark_hung(left + GRACE_S)
            raise CompileWorkerError("the grammar compile server did not answer") from None

    def server_pid(self) -> int | None:
        """The pid of the compile server that runs the checks (None before the first)."""
        return self._client.server_pid()

    def close(self) -> None:
        """Stop the compile server (checks under way fail)."""
        self._client.close()
