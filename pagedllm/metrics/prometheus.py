"""Prometheus collectors of the server, labelled by the served model name.

The names are vLLM's (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, ...), so that dashboards,
alerts and autoscalers written for vLLM read a pagedllm server unchanged; every family is also exposed
under the `pagedllm:` prefix that earlier versions used.

Each `PrometheusStatLogger` owns its own `CollectorRegistry` (served by ``/metrics``), so several
servers or test apps in one process never collide in prometheus_client's global registry. With data
parallelism every series also carries vLLM's `engine="<data parallel rank>"` label, one series per core.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pagedllm.core.outputs import SchedulerStats
from pagedllm.metrics.stats import IterationStats

_LATENCY_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip


# Tokens in one engine step: a decode step of a few requests up to a long prefill chunk.
_ITERATION_TOKEN_BUCKETS = [
    1.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
    256.0,
    512.0,
    1024.0,
    2048.0,
    4096.0,
    8192.0,
    16384.0,
]
# vllm:request_params_n's buckets.
_N_BUCKETS = [1.0, 2.0, 5.0, 10.0, 20.0]
# Where a prompt token's KV came from (vllm:prompt_tokens_by_source's source label).
_PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# vllm:engine_sleep_state's states: awake, or asleep at level 1 (weights offloaded) or 2 (discarded).
_SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
PREFIX = "vllm:"
ALIAS_PREFIX = "pagedllm:"


class _Aliases(Collector):
    """The families of a registry again, under the `pagedllm:` prefix."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            alias = Metric(family.name.replace(PREFIX, ALIAS_PREFIX, 1), family.documentation, family.type)
            alias.samples = [s._replace(name=s.name.replace(PREFIX, ALIAS_PREFIX, 1)) for s in family.samples]
            yield alias


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


class _Families:
    """The metric families of one registry, created once and shared by the engines' series."""

    def __init__(self, registry: CollectorRegistry, label_names: list[str]) -> None:
        self.registry = registry
        self.label_names = label_names
        self._made: dict[str, Any] = {}

    def _family(self, kind: type, name: str, doc: str, extra: tuple[str, ...], **kwargs: Any) -> Any:
        if name not in self._made:
            labels = [*self.label_names, *extra]
            self._made[name] = kind(f"{PREFIX}{name}", doc, labels, registry=self.registry, **kwargs)
        return self._made[name]

    def gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return self._family(Gauge, name, doc, extra)

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return self._family(Counter, name, doc, extra)

    def histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        return self._family(Histogram, name, doc, (), buckets=buckets)

    def gauge_without_labels(self, name: str, doc: str, labels: tuple[str, ...]) -> Gauge:
        """A gauge with only its own labels (not the model's nor the engine's), as vLLM has some."""
        if name not in self._made:
            self._made[name] = Gauge(f"{PREFIX}{name}", doc, list(labels), registry=self.registry)
        return self._made[name]


class SpecDecodingProm:
    """vllm:spec_decode_* counters; the per-position one is labelled with the draft position."""

    def __init__(self, families: _Families, labels: tuple[str, ...]) -> None:
        self.num_drafts = families.counter(
            "spec_decode_num_drafts", "Number of spec decoding drafts."
        ).labels(*labels)
        self.num_draft_tokens = families.counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens."
        ).labels(*labels)
        self.num_accepted_tokens = families.counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        ).labels(*labels)
        self._per_pos = families.counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ("position",)
        )
        self._labels = labels

    def record(self, stats: SchedulerStats) -> None:
        self.num_drafts.inc(stats.spec_num_drafts)
        self.num_draft_tokens.inc(stats.spec_num_draft_tokens)
        self.num_accepted_tokens.inc(stats.spec_num_accepted_tokens)
        for pos, n in enumerate(stats.spec_num_accepted_tokens_per_pos):
            self._per_pos.labels(*self._labels, str(pos)).inc(n)


class PrometheusStatLogger:
    """The server's metrics: one set of series per engine core (``engine_indexes``: the data parallel
    ranks served, each then labelled `engine="<rank>"`; None: one core and no engine label)."""

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        max_loras: int | None = None,
        speculative: bool = False,
        engine_indexes: list[int] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._aliases = CollectorRegistry()
        self._aliases.register(_Aliases(self.registry))
        label_names = ["model_name"] if engine_indexes is None else ["model_name", "engine"]
        families = _Families(self.registry, label_names)
        self._families = families
        self._engine_labels = {
            index: (model_name,) if engine_indexes is None else (model_name, str(index))
            for index in (engine_indexes or [0])
        }
        self._engines = {
            index: _EngineMetrics(
                families,
                (model_name,) if engine_indexes is None else (model_name, str(index)),
                max_model_len,
                max_loras,
                speculative,
            )
            for index in (engine_indexes or [0])
        }

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        engine_index: int = 0,
    ) -> None:
        """Count what one core (``engine_index``, its data parallel rank) reported."""
        self._engines[engine_index].record(scheduler_stats, iteration_stats)

    def log_cache_config(self, cache_config: dict[str, Any]) -> None:
        """vllm:cache_config_info: the KV cache's configuration as labels of a gauge set to 1, one series
        per engine (an info metric, as vLLM emulates it)."""
        labels = {key: str(value) for key, value in cache_config.items()}
        info = Gauge(
            f"{PREFIX}cache_config_info",
            "Information of the LLMEngine CacheConfig.",
            [*labels, "engine"],
            registry=self.registry,
        )
        for index in self._engines:
            info.labels(*labels.values(), str(index)).set(1)

    def record_sleep_state(self, level: int) -> None:
        """vllm:engine_sleep_state: 0 awake, else the sleep level (1 offloads the weights, 2 discards)."""
        gauge = self._families.gauge(
            "engine_sleep_state",
            "Engine sleep state: awake = 1 when awake; weights_offloaded = 1 at sleep level 1; "
            "discard_all = 1 at sleep level 2.",
            ("sleep_state",),
        )
        for labels in self._engine_labels.values():
            for state_level, state in enumerate(_SLEEP_STATES):
                on = level == 0 if state_level == 0 else level == state_level
                gauge.labels(*labels, state).set(int(on))

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(self._aliases)


class _EngineMetrics:
    """The series of one engine core (its label values: the model name, and the engine with DP)."""

    def __init__(
        self,
        families: _Families,
        labels: tuple[str, ...],
        max_model_len: int,
        max_loras: int | None,
        speculative: bool,
    ) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return families.gauge(name, doc).labels(*labels)

        def counter(name: str, doc: str) -> Counter:
            return families.counter(name, doc).labels(*labels)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return families.histogram(name, doc, buckets).labels(*labels)

        self.num_requests_running = gauge("num_requests_running", "Requests being processed by the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens looked up in the KV connector (after local hits)."
        )
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens loaded from the KV connector instead of computed."
        )
        # The connector's transfers, by direction (load: into the KV cache, save: out of it).
        self._kv_transfer_bytes = families.counter(
            "kv_transfer_bytes", "Bytes of KV cache the KV connector moved.", ("transfer_type",)
        )
        self._kv_transfer_time = families.counter(
            "kv_transfer_time_seconds", "Seconds the KV connector spent moving KV cache.", ("transfer_type",)
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        by_source = families.counter(
            "prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",)
        )
        self.prompt_tokens_by_source = {
            source: by_source.labels(*labels, source) for source in _PROMPT_SOURCES
        }
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.prompt_tokens_recomputed = counter(
            "prompt_tokens_recomputed", "Number of cached tokens recomputed for forward pass."
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = families.counter(
            "request_success", "Requests finished, by finish reason.", ("finished_reason",)
        )
        self._labels = labels
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs of a request.", _LATENCY_BUCKETS
        )
        # vLLM keeps this older name of the inter-token latency for existing dashboards.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Time between consecutive outputs of a request.",
            _LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time between the tokens of a finished request.",
            _LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token.", _LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Prompt and generated tokens of one engine step.",
            _ITERATION_TOKEN_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Arrival to the first time the scheduler scheduled the request.",
            _LATENCY_BUCKETS,
        )
        # vLLM's LoRA info gauge: its labels are the adapters now running / waiting (comma-separated
        # names), its value the time they were last reported. Only with LoRA enabled; not per engine.
        self._max_loras = max_loras
        self.lora_requests_info = (
            families.gauge_without_labels(
                "lora_requests_info",
                "Running stats on LoRA requests.",
                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
            )
            if max_loras is not None
            else None
        )
        token_buckets = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated length of finished requests.", token_buckets
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a request's n choices.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "New KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        # vLLM's speculative-decoding counters, registered only when a drafter is configured.
        self.spec: SpecDecodingProm | None = SpecDecodingProm(families, labels) if speculative else None

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            # The core's counters are per step (reset each time it reports).
            self.prefix_cache_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(scheduler_stats.prefix_cache_hits)
            self.num_preemptions.inc(scheduler_stats.num_preemptions)
            self.external_prefix_cache_queries.inc(scheduler_stats.external_prefix_cache_queries)
            self.external_prefix_cache_hits.inc(scheduler_stats.external_prefix_cache_hits)
            kv = scheduler_stats.kv_connector_stats
            for kind, bytes_key in (("load", "bytes_loaded"), ("save", "bytes_saved")):
                if bytes_key in kv:
                    self._kv_transfer_bytes.labels(*self._labels, kind).inc(kv[bytes_key])
                if f"{kind}_time_s" in kv:
                    self._kv_transfer_time.labels(*self._labels, kind).inc(kv[f"{kind}_time_s"])
            if self.lora_requests_info is not None:
                # One series: the current adapters (an old label set would otherwise linger forever).
                self.lora_requests_info.clear()
                self.lora_requests_info.labels(
                    str(self._max_loras),
                    ",".join(sorted(scheduler_stats.waiting_lora_adapters)),
                    ",".join(sorted(scheduler_stats.running_lora_adapters)),
                ).set_to_current_time()
            if self.spec is not None:
                self.spec.record(scheduler_stats)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        for source, count in zip(
            _PROMPT_SOURCES,
            (
                iteration_stats.num_prompt_tokens_computed,
                iteration_stats.num_prompt_tokens_local_hit,
                iteration_stats.num_prompt_tokens_external,
            ),
        ):
            self.prompt_tokens_by_source[source].inc(count)
        self.prompt_tokens_cached.inc(
            iteration_stats.num_prompt_tokens_local_hit
            + iteration_stats.num_prompt_tokens_external
            - iteration_stats.num_prompt_tokens_recomputed
        )
        self.prompt_tokens_recomputed.inc(iteration_stats.num_prompt_tokens_recomputed)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
            self.time_per_output_token.observe(itl)
        for finished in iteration_stats.finished_requests:
            self._request_success.labels(*self._labels, str(finished.finish_reason)).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            for histogram, value in (
                (self.request_queue_time, finished.queue_time),
                (self.request_prefill_time, finished.prefill_time),
                (self.request_decode_time, finished.decode_time),
                (self.request_inference_time, finished.inference_time),
                (self.request_time_per_output_token, finished.time_per_output_token),
            ):
                # Phases a request never reached (aborted while waiting) are left out, not made zero.
                if value is not None:
                    histogram.observe(value)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.max_tokens_param:
                self.request_params_max_tokens.observe(finished.max_tokens_param)
            if finished.params_n is not None and finished.max_num_generation_tokens is not None:
                self.request_params_n.observe(finished.params_n)
                self.request_max_num_generation_tokens.observe(finished.max_num_generation_tokens)
            if finished.prefill_time is not None:
                # A request that reached its prefill computed its prompt's uncached tokens.
                self.request_prefill_kv_computed_tokens.observe(
                    finished.num_prompt_tokens - finished.num_cached_tokens
                )
