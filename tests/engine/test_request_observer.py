"""RequestObserver.from_config: a request logger with --enable-log-requests, a tracer with an OTLP
endpoint, nothing (no per-request cost) without either."""

from __future__ import annotations

from scripted_model import fake_engine_config

from pagedllm.config import LoggingConfig, ObservabilityConfig
from pagedllm.engine.request_observer import RequestObserver


def test_from_config() -> None:
    assert RequestObserver.from_config(fake_engine_config(), "m", log_requests=False) is None
    logs = RequestObserver.from_config(
        fake_engine_config(logging_config=LoggingConfig(max_log_len=7)), "m", log_requests=True
    )
    assert logs is not None and logs.tracer is None
    assert logs.request_logger is not None and logs.request_logger.max_log_len == 7
    traced_config = fake_engine_config(
        observability_config=ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:1/v1/traces")
    )
    traced_config.model_config.served_model_name = ["first", "second"]
    traced = RequestObserver.from_config(traced_config, None, log_requests=False)
    assert traced is not None and traced.request_logger is None
    assert traced.tracer is not None and traced.tracer.model_name == "first"
