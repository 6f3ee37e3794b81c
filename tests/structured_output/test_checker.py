"""The server's check of a constraint: the grammar engine's conversion runs in a compile worker process that
is killed at the budget (a slow one is refused while the loop keeps serving, and nothing of it goes on),
the limits refuse at once, and a good constraint comes back with its backend resolved."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import psutil
import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.checker import ConstraintChecker
from pagedllm.structured_output.params import StructuredOutputsParams

# The limits are lifted to let this by: half a minute or more of xgrammar's conversion (27 s on a quiet Zen 5).
VERY_SLOW = {"type": "string", "pattern": "[a-z]{1,20000}"}
GOOD = {"type": "object", "properties": {"a": {"type": "integer"}}}


async def _max_gap_while(task: asyncio.Future, tick: float = 0.01) -> float:
    """The longest the event loop went without running a 10 ms ticker while ``task`` ran."""
    gap, last = 0.0, time.monotonic()
    while not task.done():
        await asyncio.sleep(tick)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


BUDGET_S = 3.0


@pytest.fixture(scope="module")
def checker() -> Iterator[tuple[ConstraintChecker, asyncio.AbstractEventLoop]]:
    """One checker (and its compile server) for the module, with the regex limit lifted, on one loop."""
    config = StructuredOutputsConfig(max_regex_repetition=10**6, validation_timeout_s=BUDGET_S)
    loop = asyncio.new_event_loop()
    # One worker: a check can run only if the one before it no longer holds it.
    checker = ConstraintChecker(config, max_workers=1)
    try:
        yield checker, loop
    finally:
        checker.close()
        loop.close()


def test_a_check_past_its_budget_is_refused_and_killed_while_the_loop_keeps_running(
    checker: tuple[ConstraintChecker, asyncio.AbstractEventLoop],
) -> None:
    check, loop = checker

    async def scenario() -> None:
        # The first check starts the compile server (it imports the grammar engines: not timed).
        await check.check(StructuredOutputsParams(json=GOOD))
        server = check.server_pid()
        assert server is not None
        # The one worker, idle: it takes the next check.
        (worker,) = psutil.Process(server).children()
        start = time.monotonic()
        task = asyncio.ensure_future(check.check(StructuredOutputsParams(json=VERY_SLOW)))
        gap = await _max_gap_while(task)
        elapsed = time.monotonic() - start
        error = task.exception()
        assert isinstance(error, ValueError)
        assert str(error).startswith(f"structured_outputs.json could not be checked within {BUDGET_S:g} s"), (
            error
        )
        assert "validation_timeout_s" in str(error)
        # Generous for a loaded machine, far below the conversion's half minute; a blocked loop would
        # have stalled for all of it.
        assert elapsed < BUDGET_S + 10 and gap < 1.0, (elapsed, gap)
        # Nothing of the check goes on: its worker was killed (a thread went on converting for as long as
        # the conversion took), and the next check gets a fresh one at once.
        _, alive = psutil.wait_procs([worker], timeout=5)
        assert alive == [], alive
        start = time.monotonic()
        params = StructuredOutputsParams(json=GOOD)
        await check.check(params)
        assert params.resolved_backend == "xgrammar" and time.monotonic() - start < BUDGET_S
        assert check.server_pid() == server
        assert [p.pid for p in psutil.Process(server).children()] != [worker.pid]

    loop.run_until_complete(scenario())


def test_limits_refuse_at_once_and_good_constraints_resolve(
    checker: tuple[ConstraintChecker, asyncio.AbstractEventLoop],
) -> None:
    check, loop = checker

    async def scenario() -> None:
        with pytest.raises(ValueError, match="max_enum_members"):
            await check.check(StructuredOutputsParams(json={"enum": list(range(1001))}))
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            await check.check(StructuredOutputsParams(regex="a(b"))
        params = StructuredOutputsParams(json={"type": "object"})
        await check.check(params)
        assert params.resolved_backend == "xgrammar"
        params = StructuredOutputsParams(json={"type": "string"}, whitespace_pattern=r"[ ]?")
        await check.check(params)
        # xgrammar does not take a whitespace pattern: the fallback takes it.
        assert params.resolved_backend == "guidance"

    loop.run_until_complete(scenario())
