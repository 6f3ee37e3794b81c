"""ObservabilityConfig, LoggingConfig and ProfilerConfig: metrics, traces, logs and profiling."""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from pagedllm.config.utils import config, hash_fields

OTEL_EXTRA = "pip install 'pagedllm[otel]'"
_OTEL_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp")


def otel_missing() -> str | None:
    """Why tracing cannot be enabled here (a message naming the extra), or None when it can."""
    missing = [m for m in _OTEL_MODULES if _find_spec(m) is None]
    if not missing:
        return None
    return f"tracing needs the OpenTelemetry SDK and OTLP exporter ({', '.join(missing)} not found): {OTEL_EXTRA}"


def _find_spec(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except ModuleNotFoundError:  # the parent package is missing
        return None


@config
class ObservabilityConfig:
    """Configuration of metrics and tracing."""

    show_hidden_metrics_for_version: str | None = None
    """Re-enable metrics deprecated since this version (pagedllm hides none: not supported)."""
    otlp_traces_endpoint: str | None = None
    """OpenTelemetry (OTLP) endpoint to send request traces to: one `llm_request` span per request. The
    protocol follows OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc or http/protobuf). Needs the `otel` extra."""
    collect_detailed_traces: list[Literal["all", "model", "worker"]] | None = None
    """Also trace each engine step: `worker` (execute_model and sample_tokens spans), `model` (model_forward
    spans) or `all`. Needs --otlp-traces-endpoint; costs a few spans per step."""
    per_request_spec_decode_metrics: Literal["none", "summary", "detailed"] = "none"
    """Per-request speculative decoding acceptance metrics."""

    @field_validator("collect_detailed_traces", mode="before")
    @classmethod
    def _split_modules(cls, value: Any) -> Any:
        # As vLLM: "model,worker" given as one value is two modules.
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            value = [m.strip() for v in value for m in (v.split(",") if isinstance(v, str) else [v])]
        return value

    def __post_init__(self) -> None:
        if self.collect_detailed_traces and not self.otlp_traces_endpoint:
            raise ValueError("collect_detailed_traces requires `--otlp-traces-endpoint` to be set.")
        if self.otlp_traces_endpoint is not None:
            missing = otel_missing()
            if missing is not None:
                raise ValueError(f"otlp_traces_endpoint: {missing}")

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
    """Log every request: its id, prompt and sampling parameters when it arrives, its output when it ends."""
    max_log_len: Annotated[int, Field(ge=0)] | None = None
    """Longest prompt or output text (characters) and token-id list printed in request logs; unset prints
    them whole."""

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
