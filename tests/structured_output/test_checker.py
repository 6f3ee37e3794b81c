"""The server's check of a constraint: the grammar engine's conversion runs off the event loop within a time
budget (a slow one is refused while the loop keeps serving), the limits refuse at once, and a good
constraint comes back with its backend resolved."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.checker import ConstraintChecker
from pagedllm.structured_output.params import StructuredOutputsParams

# Converting this takes xgrammar seconds (quadratic in the repetition); the limits are lifted to let it by.
SLOW = {"type": "string", "pattern": "[a-z]{1,4000}"}


async def _max_gap_while(task: asyncio.Future, tick: float = 0.01) -> float:
    """The longest the event loop went without running a 10 ms ticker while ``task`` ran."""
    gap, last = 0.0, time.monotonic()
    while not task.done():
        await asyncio.sleep(tick)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


def test_a_slow_conversion_is_refused_within_the_budget_and_the_loop_keeps_running() -> None:
    config = StructuredOutputsConfig(max_regex_repetition=10**6, validation_timeout_s=0.5)
    checker = ConstraintChecker(config)

    async def scenario() -> tuple[float, float, BaseException | None]:
        start = time.monotonic()
        task = asyncio.ensure_future(checker.check(StructuredOutputsParams(json=SLOW)))
        gap = await _max_gap_while(task)
        return time.monotonic() - start, gap, task.exception()

    elapsed, gap, error = asyncio.run(scenario())
    assert isinstance(error, ValueError)
    assert str(error).startswith("structured_outputs.json could not be checked within 0.5 s")
    # Generous for a loaded machine; on the loop the conversion stalled everything for its whole length.
    assert elapsed < 5 and gap < 1.0, (elapsed, gap)


def test_limits_refuse_at_once_and_good_constraints_resolve() -> None:
    checker = ConstraintChecker(StructuredOutputsConfig())

    async def scenario() -> None:
        with pytest.raises(ValueError, match="max_regex_repetition"):
            await checker.check(StructuredOutputsParams(json=SLOW))
        with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
            await checker.check(StructuredOutputsParams(regex="a(b"))
        params = StructuredOutputsParams(json={"type": "object"})
        await checker.check(params)
        assert params.resolved_backend == "xgrammar"

    asyncio.run(scenario())
