"""The periodic statistics log line of the server (every `log_stats_interval` seconds while busy)."""

from __future__ import annotations

import logging
import time

from pagedllm.core.outputs import SchedulerStats
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger("pagedllm.metrics")


class LoggingStatLogger:
    """Accumulates token counts between log lines; `log()` prints one line unless the engine was idle."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._last_log_time = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._spec_drafts = 0
        self._spec_accepted = 0
        # The last stats of each engine core (one per data parallel rank): the line sums them.
        self._last_stats: dict[int, SchedulerStats] = {}
        # Whether the previous line showed activity: one idle line follows the last busy one, so the log
        # ends on the real state (0 running) instead of stale throughput.
        self._last_was_busy = False

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self._last_stats[engine_index] = scheduler_stats
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits
            self._spec_drafts += scheduler_stats.spec_num_drafts
            self._spec_accepted += scheduler_stats.spec_num_accepted_tokens
        if iteration_stats is not None:
            self._num_prompt_tokens += iteration_stats.num_prompt_tokens
            self._num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self, now: float | None = None) -> str | None:
        """Log (and return) the line for the interval since the last call, or None when idle throughout."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_log_time, 1e-9)
        cores = list(self._last_stats.values()) or [SchedulerStats()]
        running = sum(s.num_running_reqs for s in cores)
        waiting = sum(s.num_waiting_reqs for s in cores)
        kv_usage = sum(s.kv_cache_usage for s in cores) / len(cores)
        busy = bool(self._num_prompt_tokens or self._num_generation_tokens or running or waiting)
        if not busy and not self._last_was_busy:
            self._last_log_time = now
            return None
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        line = (
            f"Avg prompt throughput: {self._num_prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._num_generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {kv_usage * 100:.1f}%, Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        if self._spec_drafts:
            # vLLM's definition: tokens emitted per verification (the target's own token included).
            line += f", Mean acceptance length: {1 + self._spec_accepted / self._spec_drafts:.2f}"
        self._log.info("%s", line)
        self._last_was_busy = busy
        self._last_log_time = now
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._spec_drafts = self._spec_accepted = 0
        return line
