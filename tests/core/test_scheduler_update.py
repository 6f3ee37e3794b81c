"""The scheduler's output stage: its counters are taken once per stats report, then start from zero."""

from __future__ import annotations

from pagedllm.core.scheduler_update import SchedulerCounters


def test_counters_take_returns_the_counts_and_restarts() -> None:
    counters = SchedulerCounters()
    counters.num_preemptions = 2
    counters.external_queries, counters.external_hits = 32, 16
    counters.kv_connector_stats["bytes_loaded"] = 4096.0
    counters.spec.observe(3, 2)
    taken = counters.take()
    assert (taken.num_preemptions, taken.external_queries, taken.external_hits) == (2, 32, 16)
    assert taken.kv_connector_stats == {"bytes_loaded": 4096.0}
    assert (taken.spec.num_drafts, taken.spec.num_accepted_tokens_per_pos) == (1, [1, 1, 0])
    # The next report counts from zero, and what was taken is not shared with the live counters.
    assert counters == SchedulerCounters()
    counters.kv_connector_stats["bytes_loaded"] = 1.0
    counters.spec.observe(1, 1)
    assert taken.kv_connector_stats == {"bytes_loaded": 4096.0} and taken.spec.num_drafts == 1
