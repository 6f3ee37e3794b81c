"""OpenTelemetry traces: one `llm_request` span per finished request, and step spans on demand.

As vLLM: `observability_config.otlp_traces_endpoint` turns tracing on; the front-end ends each user
request with a SERVER span named `llm_request`, carrying vLLM's `gen_ai.*` attribute names, started at
the request's arrival and ended when it finished, whose parent is the W3C `traceparent` the client sent
(so the engine's span joins the caller's trace). `collect_detailed_traces` adds spans around each step's
work in the engine core: `execute_model` and `sample_tokens` ("worker") and `model_forward` ("model",
nested in `execute_model` when both are on). Steps batch many requests, so these are spans of their own
trace, not children of one request's span.

The SDK and the OTLP exporter are the optional extra `otel`, imported only when tracing is on. The
exporter's protocol follows OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (`grpc`, the default, or
`http/protobuf`, for which the endpoint is the full URL, e.g. http://host:4318/v1/traces), as in vLLM.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pagedllm import envs
from pagedllm.config.observability import otel_missing

if TYPE_CHECKING:
    from pagedllm.config.observability import ObservabilityConfig
    from pagedllm.outputs import RequestMetrics
    from pagedllm.sampling_params import SamplingParams

# The W3C trace-context headers a request may carry.
TRACE_HEADERS = ("traceparent", "tracestate")


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), so dashboards built for vLLM read pagedllm's spans."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The trace-context headers of an incoming request (None when it has none)."""
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    return found or None


@functools.cache
def _provider(endpoint: str) -> Any:
    """One tracer provider per process and endpoint: the front-end and the worker of an offline engine
    share it, and every engine of a process exports through one batch queue."""
    missing = otel_missing()
    if missing is not None:
        raise ValueError(f"observability_config.otlp_traces_endpoint: {missing}")
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    else:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported (only 'grpc' and 'http/protobuf')"
        )
    provider = TracerProvider(resource=Resource.create({"service.name": "pagedllm"}))
    # Exported in the background: a slow or absent collector never holds up a step.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


# Endpoints with a provider in this process (functools.cache cannot list its keys).
_OPENED: set[str] = set()


def get_tracer(endpoint: str, name: str) -> Any:
    tracer = _provider(endpoint).get_tracer(name)
    _OPENED.add(endpoint)
    return tracer


def flush_traces(timeout_s: float = 10.0) -> None:
    """Export what the batch queues hold (at shutdown: the process may end before their next export)."""
    for endpoint in _OPENED:
        _provider(endpoint).force_flush(int(timeout_s * 1000))


class RequestTracer:
    """Sends the `llm_request` span of each finished request."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = get_tracer(endpoint, "pagedllm.engine")
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self.model_name = model_name

    def trace(
        self,
        request_id: str,
        params: SamplingParams,
        num_prompt_tokens: int,
        metrics: RequestMetrics,
        trace_headers: Mapping[str, str] | None,
    ) -> None:
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: self.model_name,
            SpanAttributes.GEN_AI_REQUEST_N: params.n,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: metrics.num_generation_tokens,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: metrics.time_in_queue,
            SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: metrics.time_to_first_token,
            SpanAttributes.GEN_AI_LATENCY_E2E: metrics.e2e_latency,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: metrics.prefill_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: metrics.decode_time,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: metrics.inference_time,
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        # A request that ended before its first token has no prefill or decode time: OpenTelemetry
        # attributes cannot be None, so those are left out.
        attributes = {k: v for k, v in attributes.items() if v is not None}
        context = self._propagator.extract(dict(trace_headers)) if trace_headers else None
        end = metrics.finished_time
        span = self._tracer.start_span(
            "llm_request",
            context=context,
            kind=self._kind,
            attributes=attributes,
            start_time=int(metrics.arrival_time * 1e9),
        )
        span.end(end_time=None if end is None else int(end * 1e9))


StepSpan = Callable[[Mapping[str, Any] | None], contextlib.AbstractContextManager[Any]]


def _no_span(attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


def step_span(config: ObservabilityConfig, module: str, name: str) -> StepSpan:
    """A factory of spans named ``name`` (given their attributes) when `collect_detailed_traces` selects
    ``module`` ("model" or "worker"); otherwise of no-op contexts, so a step pays nothing when detailed
    traces are off. A span opened inside another one of the same thread becomes its child."""
    modules = config.collect_detailed_traces or []
    endpoint = config.otlp_traces_endpoint
    if endpoint is None or (module not in modules and "all" not in modules):
        return _no_span
    tracer = get_tracer(endpoint, f"pagedllm.{module}")

    def span(attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager[Any]:
        return tracer.start_as_current_span(name, attributes=attributes)

    return span
