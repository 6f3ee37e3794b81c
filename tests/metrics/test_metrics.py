"""Front-end statistics, Prometheus collectors and the periodic log line, with no engine."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.engine.protocol import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from pagedllm.errors import ErrorReport
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger, _token_buckets
from pagedllm.metrics.stats import IterationStats, RequestStatsTracker


def _outputs(
    *items: tuple[str, list[int], FinishReason | None], scheduled: dict[str, float] | None = None
) -> EngineCoreOutputs:
    """Core outputs; ``scheduled`` gives the first-scheduled time the core reports for some requests."""
    scheduled = scheduled or {}
    return EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(rid, toks, finish_reason=fr, first_scheduled_time=scheduled.get(rid))
            for rid, toks, fr in items
        ]
    )


def test_tracker_latencies_and_token_counts() -> None:
    tracker = RequestStatsTracker()
    tracker.add_request("a", num_prompt_tokens=7, arrival_time=100.0)
    tracker.add_request("b", num_prompt_tokens=3, arrival_time=100.5)
    # A step where "a" is still mid-prefill produces nothing for it.
    first = tracker.update(_outputs(("b", [5], None), scheduled={"b": 100.75}), now=101.0)
    assert first.num_prompt_tokens == 3
    assert first.num_generation_tokens == 1
    assert first.time_to_first_tokens == [pytest.approx(0.5)]
    assert first.inter_token_latencies == []
    second = tracker.update(_outputs(("a", [1], None), ("b", [6, 7], FinishReason.LENGTH)), now=101.25)
    assert second.num_prompt_tokens == 7
    assert second.num_generation_tokens == 3
    assert second.time_to_first_tokens == [pytest.approx(1.25)]
    assert second.inter_token_latencies == [pytest.approx(0.25)]
    [finished] = second.finished_requests
    assert finished.finish_reason == FinishReason.LENGTH
    assert finished.e2e_latency == pytest.approx(0.75)
    assert (finished.num_prompt_tokens, finished.num_generation_tokens) == (3, 3)
    # Queue time ends when the core first scheduled "b", not at its first token (0.5 s after arrival).
    assert finished.queue_time == pytest.approx(0.25)
    # Outputs of a request no longer tracked (finished, aborted) are ignored.
    assert tracker.update(_outputs(("b", [8], None)), now=102.0).num_generation_tokens == 0


def test_tracker_finish_request_by_front_end() -> None:
    tracker = RequestStatsTracker()
    tracker.add_request("a", num_prompt_tokens=4, arrival_time=10.0)
    tracker.update(_outputs(("a", [1, 2], None)), now=11.0)
    stats = tracker.finish_request("a", FinishReason.ABORT, now=12.0)
    assert stats is not None
    assert stats.finish_reason == FinishReason.ABORT
    assert stats.num_generation_tokens == 2
    assert stats.e2e_latency == pytest.approx(2.0)
    assert tracker.finish_request("a", FinishReason.ABORT) is None


def test_tracker_queue_time_unknown_or_skewed() -> None:
    tracker = RequestStatsTracker()
    for request_id in ("late", "waiting", "skewed"):
        tracker.add_request(request_id, num_prompt_tokens=4, arrival_time=10.0)
    # Reported once, with the first output; a later output without it does not erase it.
    tracker.update(_outputs(("late", [1], None), scheduled={"late": 10.5}), now=11.0)
    [late] = tracker.update(_outputs(("late", [2], FinishReason.STOP)), now=12.0).finished_requests
    assert late.queue_time == pytest.approx(0.5)
    # Aborted before the core scheduled it: no queue time is known, and none is made up.
    waiting = tracker.finish_request("waiting", FinishReason.ABORT, now=13.0)
    assert waiting is not None and waiting.queue_time is None
    # The core's wall clock read earlier than the arrival (a clock step): no negative wait.
    [skewed] = tracker.update(
        _outputs(("skewed", [1], FinishReason.STOP), scheduled={"skewed": 9.5}), now=11.0
    ).finished_requests
    assert skewed.queue_time == 0.0
    # Only known queue times reach the histogram; the request counts everywhere else.
    prom = PrometheusStatLogger("m", 128)
    prom.record(None, IterationStats(finished_requests=[late, waiting]))
    samples = _samples(prom)
    model = (("model_name", "m"),)
    assert samples[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert samples[("vllm:request_queue_time_seconds_count", model)] == 1
    assert samples[("vllm:request_queue_time_seconds_sum", model)] == pytest.approx(0.5)
    # The phases a request never reached are left out: "waiting" was never scheduled.
    assert samples[("vllm:request_prefill_time_seconds_count", model)] == 1
    assert samples[("vllm:request_decode_time_seconds_sum", model)] == pytest.approx(1.0)


def test_tracker_forgets_rejected_requests() -> None:
    tracker = RequestStatsTracker()
    tracker.add_request("bad", num_prompt_tokens=4)
    tracker.update(EngineCoreOutputs(errors={"bad": ErrorReport("too long")}))
    assert tracker.finish_request("bad", FinishReason.ABORT) is None


def _samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    result = {}
    for family in text_string_to_metric_families(logger.render().decode()):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def test_prometheus_records_gauges_counters_histograms() -> None:
    prom = PrometheusStatLogger("my-model", max_model_len=2048)
    tracker = RequestStatsTracker()
    tracker.add_request("a", num_prompt_tokens=5, arrival_time=0.0)
    stats = SchedulerStats(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=32,
        prefix_cache_hits=16,
    )
    prom.record(stats, tracker.update(_outputs(("a", [1], None), scheduled={"a": 0.125}), now=0.5))
    prom.record(stats, tracker.update(_outputs(("a", [2, 3], FinishReason.STOP)), now=0.75))
    samples = _samples(prom)
    model = (("model_name", "my-model"),)
    assert samples[("vllm:num_requests_running", model)] == 2
    assert samples[("vllm:num_requests_waiting", model)] == 1
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:prefix_cache_queries_total", model)] == 64
    assert samples[("vllm:prefix_cache_hits_total", model)] == 32
    assert samples[("vllm:prompt_tokens_total", model)] == 5
    assert samples[("vllm:generation_tokens_total", model)] == 3
    assert (
        samples[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "my-model")))]
        == 1
    )
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 1
    assert samples[("vllm:time_to_first_token_seconds_sum", model)] == pytest.approx(0.5)
    assert samples[("vllm:inter_token_latency_seconds_sum", model)] == pytest.approx(0.25)
    assert samples[("vllm:e2e_request_latency_seconds_sum", model)] == pytest.approx(0.75)
    assert samples[("vllm:request_queue_time_seconds_count", model)] == 1
    assert samples[("vllm:request_queue_time_seconds_sum", model)] == pytest.approx(0.125)
    assert samples[("vllm:request_prompt_tokens_sum", model)] == 5
    assert samples[("vllm:request_generation_tokens_sum", model)] == 3
    # vLLM's per-phase times: scheduled at 0.125, first token at 0.5, last at 0.75 (three tokens).
    assert samples[("vllm:request_prefill_time_seconds_sum", model)] == pytest.approx(0.375)
    assert samples[("vllm:request_decode_time_seconds_sum", model)] == pytest.approx(0.25)
    assert samples[("vllm:request_inference_time_seconds_sum", model)] == pytest.approx(0.625)
    assert samples[("vllm:request_time_per_output_token_seconds_sum", model)] == pytest.approx(0.125)
    assert samples[("vllm:time_per_output_token_seconds_sum", model)] == pytest.approx(0.25)
    # Two steps: the prompt (5) with the first token, then two tokens.
    assert samples[("vllm:iteration_tokens_total_count", model)] == 2
    assert samples[("vllm:iteration_tokens_total_sum", model)] == 8
    # The earlier pagedllm: names stay, with the same values.
    for (name, labels), value in list(samples.items()):
        assert samples[(name.replace("vllm:", "pagedllm:", 1), labels)] == value
    # Idle again: the gauges follow the latest stats.
    prom.record(SchedulerStats(), None)
    samples = _samples(prom)
    assert samples[("vllm:num_requests_running", model)] == 0
    assert samples[("vllm:kv_cache_usage_perc", model)] == 0.0


def test_two_loggers_do_not_share_a_registry() -> None:
    first = PrometheusStatLogger("m", 128)
    second = PrometheusStatLogger("m", 128)
    first.record(None, IterationStats(num_generation_tokens=4))
    assert _samples(second)[("vllm:generation_tokens_total", (("model_name", "m"),))] == 0


def test_token_buckets() -> None:
    assert _token_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert _token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_log_line_while_busy_then_once_idle(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger()
    start = stat_logger._last_log_time
    # Idle from the start: nothing to say.
    assert stat_logger.log(now=start + 10) is None
    stat_logger.record(
        SchedulerStats(
            num_running_reqs=3,
            num_waiting_reqs=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
        ),
        IterationStats(num_prompt_tokens=200, num_generation_tokens=50),
    )
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics"):
        line = stat_logger.log(now=start + 20)
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 40.0%"
    )
    assert line in caplog.text
    # The engine went idle: one line with the idle state, then silence.
    stat_logger.record(SchedulerStats(), None)
    idle = stat_logger.log(now=start + 30)
    assert idle is not None and "Running: 0 reqs" in idle and "Avg generation throughput: 0.0" in idle
    assert stat_logger.log(now=start + 40) is None


def test_log_line_sums_the_data_parallel_cores() -> None:
    stat_logger = LoggingStatLogger()
    start = stat_logger._last_log_time
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5), None, 0)
    stat_logger.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.1), None, 1)
    stat_logger.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.3), None, 1)
    line = stat_logger.log(now=start + 10)
    assert line is not None
    assert "Running: 4 reqs, Waiting: 1 reqs, KV cache usage: 40.0%" in line


def test_prometheus_records_kv_connector_counters() -> None:
    prom = PrometheusStatLogger("m", max_model_len=2048)
    stats = SchedulerStats(
        external_prefix_cache_queries=48,
        external_prefix_cache_hits=32,
        kv_connector_stats={"bytes_loaded": 4096.0, "load_time_s": 0.5, "bytes_saved": 1024.0},
    )
    prom.record(stats, None)
    prom.record(stats, None)
    samples = _samples(prom)
    model = (("model_name", "m"),)
    assert samples[("vllm:external_prefix_cache_queries_total", model)] == 96
    assert samples[("vllm:external_prefix_cache_hits_total", model)] == 64
    load = (("model_name", "m"), ("transfer_type", "load"))
    save = (("model_name", "m"), ("transfer_type", "save"))
    assert samples[("vllm:kv_transfer_bytes_total", load)] == 8192
    assert samples[("vllm:kv_transfer_bytes_total", save)] == 2048
    assert samples[("vllm:kv_transfer_time_seconds_total", load)] == 1.0
    assert ("vllm:kv_transfer_time_seconds_total", save) not in samples


def test_data_parallel_ranks_get_their_own_series() -> None:
    """vLLM's `engine` label: one series per data parallel rank, each counting what its core reported."""
    prom = PrometheusStatLogger("m", 128, speculative=True, engine_indexes=[0, 1])
    tracker = RequestStatsTracker()
    tracker.add_request("a", num_prompt_tokens=2, arrival_time=0.0)
    finished = tracker.update(_outputs(("a", [1], FinishReason.STOP)), now=1.0)
    prom.record(SchedulerStats(num_running_reqs=3, spec_num_accepted_tokens_per_pos=[2]), finished, 1)
    prom.record(SchedulerStats(num_running_reqs=1), None, 0)
    samples = _samples(prom)
    running = "vllm:num_requests_running"
    assert samples[(running, (("engine", "0"), ("model_name", "m")))] == 1
    assert samples[(running, (("engine", "1"), ("model_name", "m")))] == 3
    success = "vllm:request_success_total"
    assert samples[(success, (("engine", "1"), ("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert (success, (("engine", "0"), ("finished_reason", "stop"), ("model_name", "m"))) not in samples
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert samples[(per_pos, (("engine", "1"), ("model_name", "m"), ("position", "0")))] == 2
    # One rank behind an external load balancer: its own index.
    alone = PrometheusStatLogger("m", 128, engine_indexes=[3])
    alone.record(SchedulerStats(num_running_reqs=2), None, 3)
    assert _samples(alone)[(running, (("engine", "3"), ("model_name", "m")))] == 2


def test_request_params_and_the_n_choices_of_one_request() -> None:
    prom = PrometheusStatLogger("m", max_model_len=128)
    tracker = RequestStatsTracker()
    # A request with n=2 (two core requests) and max_tokens=8, then a plain one with max_tokens=3.
    for child in ("0_p", "1_p"):
        tracker.add_request(child, num_prompt_tokens=4, arrival_time=0.0, max_tokens=8, parent=("p", 2))
    tracker.add_request("q", num_prompt_tokens=4, arrival_time=0.0, max_tokens=3)
    first = tracker.update(_outputs(("0_p", [1, 2, 3], FinishReason.STOP), ("1_p", [1], None)), now=1.0)
    # One choice finished: its user request is not done yet.
    assert [f.params_n for f in first.finished_requests] == [None]
    second = tracker.update(
        _outputs(("1_p", [2, 3, 4, 5], FinishReason.LENGTH), ("q", [7], FinishReason.STOP)), now=2.0
    )
    by_id = {f.max_tokens_param: f for f in second.finished_requests}
    assert (by_id[8].params_n, by_id[8].max_num_generation_tokens) == (2, 5)
    assert (by_id[3].params_n, by_id[3].max_num_generation_tokens) == (1, 1)
    prom.record(None, first)
    prom.record(None, second)
    samples = _samples(prom)
    model = (("model_name", "m"),)
    assert samples[("vllm:request_params_n_count", model)] == 2
    assert samples[("vllm:request_params_n_sum", model)] == 3
    assert samples[("vllm:request_params_n_bucket", (("le", "1.0"), ("model_name", "m")))] == 1
    assert samples[("vllm:request_params_max_tokens_sum", model)] == 8 + 8 + 3
    assert samples[("vllm:request_max_num_generation_tokens_sum", model)] == 5 + 1


def test_prompt_tokens_by_source() -> None:
    prom = PrometheusStatLogger("m", max_model_len=128)
    tracker = RequestStatsTracker()
    tracker.add_request("a", num_prompt_tokens=40, arrival_time=0.0)
    tracker.add_request("b", num_prompt_tokens=33, arrival_time=0.0)
    outputs = EngineCoreOutputs(
        outputs=[
            # 32 tokens from caches (16 of them loaded by a KV connector), 8 computed.
            EngineCoreOutput(
                "a", [1], num_cached_tokens=32, num_external_computed_tokens=16, first_scheduled_time=0.0
            ),
            # Fully cached: the last prompt token runs again to sample from.
            EngineCoreOutput("b", [1], finish_reason=FinishReason.STOP, num_cached_tokens=32, first_scheduled_time=0.0),
        ]
    )
    prom.record(None, tracker.update(outputs, now=1.0))
    samples = _samples(prom)
    model = (("model_name", "m"),)

    def source(name: str) -> float:
        return samples[("vllm:prompt_tokens_by_source_total", (("model_name", "m"), ("source", name)))]

    assert (source("local_compute"), source("local_cache_hit"), source("external_kv_transfer")) == (
        8 + 1,
        16 + 33,
        16,
    )
    assert samples[("vllm:prompt_tokens_cached_total", model)] == 64
    assert samples[("vllm:prompt_tokens_recomputed_total", model)] == 1
    # The finished request computed one new KV token in its prefill.
    assert samples[("vllm:request_prefill_kv_computed_tokens_sum", model)] == 1


def test_cache_config_info_and_sleep_state() -> None:
    prom = PrometheusStatLogger("m", max_model_len=128)
    prom.log_cache_config({"block_size": 16, "num_gpu_blocks": 90, "enable_prefix_caching": True})
    prom.record_sleep_state(0)
    samples = _samples(prom)
    info = (
        ("block_size", "16"),
        ("enable_prefix_caching", "True"),
        ("engine", "0"),
        ("num_gpu_blocks", "90"),
    )
    assert samples[("vllm:cache_config_info", info)] == 1

    def state(name: str) -> float:
        return _samples(prom)[("vllm:engine_sleep_state", (("model_name", "m"), ("sleep_state", name)))]

    assert (state("awake"), state("weights_offloaded"), state("discard_all")) == (1, 0, 0)
    prom.record_sleep_state(2)
    assert (state("awake"), state("weights_offloaded"), state("discard_all")) == (0, 0, 1)
