"""vLLM's spec_decode counters on /metrics and the mean acceptance length in the periodic log line."""

from __future__ import annotations

from pagedllm.core.outputs import SchedulerStats
from pagedllm.core.spec_stats import SpecDecodingStats
from pagedllm.metrics.loggers import LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger


def _stats() -> SchedulerStats:
    spec = SpecDecodingStats()
    spec.observe(3, 2)  # 3 drafts, the first 2 accepted
    spec.observe(2, 0)
    return SchedulerStats(
        num_running_reqs=2,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos,
    )


def test_prometheus_counters() -> None:
    prom = PrometheusStatLogger("m", 128, speculative=True)
    prom.record(_stats(), None)
    prom.record(_stats(), None)
    text = prom.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 10.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert 'position="2"} 0.0' in text
    # Without a drafter the counters are not registered at all.
    assert "spec_decode" not in PrometheusStatLogger("m", 128).render().decode()


def test_log_line_mean_acceptance_length() -> None:
    log = LoggingStatLogger()
    log.record(_stats(), None)
    line = log.log()
    assert line is not None and line.endswith("Mean acceptance length: 2.00")
    log.record(SchedulerStats(num_running_reqs=1), None)
    line = log.log()
    assert line is not None and "acceptance" not in line
