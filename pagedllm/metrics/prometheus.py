"""Prometheus collectors of the server, labelled by the served model name.

Each `PrometheusStatLogger` owns its own `CollectorRegistry` (served by ``/metrics``), so several
servers or test apps in one process never collide in prometheus_client's global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.protocol import SchedulerStats
from pagedllm.metrics.stats import IterationStats

_LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's 1-2-5 series)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return buckets
            buckets.append(float(value))
        exponent += 1


class PrometheusStatLogger:
    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=reg).labels(
                model_name
            )

        self.num_requests_running = gauge("num_requests_running", "Requests being processed by the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            "pagedllm:request_success",
            "Requests finished, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs of a request.", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to the first time the scheduler scheduled the request.",
            _LATENCY_BUCKETS,
        )
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated length of finished requests.", token_buckets
        )

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            # The core's counters are per step (reset each time it reports).
            self.prefix_cache_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(scheduler_stats.prefix_cache_hits)
            self.num_preemptions.inc(scheduler_stats.num_preemptions)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self._request_success.labels(self._model_name, str(finished.finish_reason)).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.request_queue_time.observe(finished.queue_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
