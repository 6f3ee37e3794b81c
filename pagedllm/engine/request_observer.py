"""`RequestObserver`: what the front-end reports about each request beyond its outputs.

The output processor calls it when a user request arrives, when each of its sequences finishes and
when the whole request finished; it writes the request log (`--enable-log-requests`) and the
`llm_request` trace span (`--otlp-traces-endpoint`). Both front-ends (the offline `LLMEngine` and the
server's `AsyncLLM`) share it, so the two report the same things.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedllm.engine.request_logger import RequestLogger
from pagedllm.metrics.tracing import RequestTracer, flush_traces

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.protocol import EngineCoreRequest
    from pagedllm.outputs import RequestMetrics
    from pagedllm.sampling_params import SamplingParams


class FinishedRequest(Protocol):
    """The parts of a finished user request (a `RequestState`, or the `ParentRequest` of n > 1) that
    are traced."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int] | None
    trace_headers: Mapping[str, str] | None

    @property
    def metrics(self) -> RequestMetrics | None: ...


class FinishedSequence(FinishedRequest, Protocol):
    """The parts of a finished output sequence (a `RequestState`) that are logged; one without a parent
    is a whole request."""

    token_ids: list[int]
    finish_reason: str | None
    parent: FinishedRequest | None

    @property
    def output_text(self) -> str | None: ...


class RequestObserver:
    def __init__(self, request_logger: RequestLogger | None, tracer: RequestTracer | None) -> None:
        self.request_logger = request_logger
        self.tracer = tracer

    @classmethod
    def from_config(
        cls, engine_config: EngineConfig, model_name: str | None, log_requests: bool
    ) -> RequestObserver | None:
        """The observer the configuration asks for (None when it asks for neither logs nor traces);
        spans name ``model_name``, by default the first served model name."""
        endpoint = engine_config.observability_config.otlp_traces_endpoint
        request_logger = RequestLogger(engine_config.logging_config.max_log_len) if log_requests else None
        tracer = None
        if endpoint is not None:
            if model_name is None:
                served = engine_config.model_config.served_model_name
                model_name = str(served[0] if isinstance(served, list) else served)
            tracer = RequestTracer(endpoint, model_name)
        if request_logger is None and tracer is None:
            return None
        return cls(request_logger, tracer)

    def request_added(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if self.request_logger is not None:
            self.request_logger.log_inputs(
                request.request_id, prompt, request.prompt_token_ids, request.sampling_params
            )

    def sequence_finished(self, sequence: FinishedSequence) -> None:
        """A sequence finished; the request of n == 1 with it (a parent reports its own finish)."""
        if self.request_logger is not None:
            self.request_logger.log_outputs(
                sequence.request_id, sequence.output_text, sequence.token_ids, sequence.finish_reason
            )
        if sequence.parent is None:
            self.request_finished(sequence)

    def request_finished(self, request: FinishedRequest) -> None:
        metrics = request.metrics
        if self.tracer is not None and metrics is not None:
            self.tracer.trace(
                request.request_id,
                request.params,
                len(request.prompt_token_ids or ()),
                metrics,
                request.trace_headers,
            )

    def shutdown(self) -> None:
        if self.tracer is not None:
            flush_traces()
