"""ObservabilityConfig, LoggingConfig and ProfilerConfig: metrics, traces, logs and profiling."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields


@config
class ObservabilityConfig:
    """Configuration of metrics and tracing."""

    show_hidden_metrics_for_version: str | None = None
    """Re-enable metrics deprecated since this version (pagedllm hides none: not supported)."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry endpoint to send request traces to."""
    collect_detailed_traces: list[Literal["all", "model", "worker"]] | None = None
    """Extra spans in traces (adds overhead)."""
    per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = "none"
    """Per-request speculative decoding acceptance metrics."""

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class LoggingConfig:
    """Configuration of logging."""

    disable_log_stats: bool = False
    """Do not log throughput and cache statistics periodically."""
    log_stats_interval: Annotated[float, Field(gt=0)] = 10.0
    """Seconds between statistics log lines."""
    enable_log_requests: bool = False
    """Log every request's parameters."""
    max_log_len: Annotated[int, Field(ge=0)] | None = None
    """Longest prompt text or token list printed in request logs (truncation is not supported yet)."""

    def compute_hash(self) -> str:
        return hash_fields(self, ())


@config
class ProfilerConfig:
    """Configuration of the profiler (started and stopped through the engine API)."""

    profiler: Literal["torch", "proton"] | None = None
    """Profiler to use; unset disables profiling."""
    torch_profiler_dir: str = ""
    """Directory for torch profiler traces."""
    proton_graph_attribution: bool = False
    """Attribute proton samples inside CUDA graphs."""
    proton_mode: str = ""
    """Proton mode, for example `pcsampling:<options>`."""

    def compute_hash(self) -> str:
        return hash_fields(self, ("profiler",))
