"""Request traces through the real OTLP exporter into an in-process collector: one `llm_request` span per
request with vLLM's attribute names, the client's traceparent as its parent, and the step spans of
collect_detailed_traces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_collector import SERVER_KIND, OTLPCollector
from tiny_llm import make_tiny_llm

from pagedllm import LLM, SamplingParams
from pagedllm.config import ObservabilityConfig, observability
from pagedllm.metrics import tracing
from pagedllm.metrics.tracing import SpanAttributes as A

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[OTLPCollector]:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    server = OTLPCollector()
    try:
        yield server
    finally:
        server.close()


def test_offline_spans_per_request_with_parent_and_step_spans(
    tmp_path: Path, collector: OTLPCollector
) -> None:
    model = make_tiny_llm(tmp_path / "tiny")
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        optimization_level=0,
        otlp_traces_endpoint=collector.url,
        collect_detailed_traces=["all"],
        served_model_name="tiny",
    )
    engine = llm.llm_engine
    prompt = "The quick brown fox"
    engine.add_request(
        "traced",
        prompt,
        SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, ignore_eos=True),
        trace_headers={"traceparent": TRACEPARENT},
    )
    engine.add_request("fanned", prompt, SamplingParams(n=2, max_tokens=3, temperature=1.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()  # flushes the batch queue

    spans = {s.attributes[A.GEN_AI_REQUEST_ID]: s for s in collector.wait_for("llm_request", 2)}
    assert sorted(spans) == ["fanned", "traced"]  # one span per request, n > 1 included
    assert len(collector.named("llm_request")) == 2
    traced, fanned = spans["traced"], spans["fanned"]
    assert traced.kind == SERVER_KIND
    assert (traced.trace_id, traced.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert fanned.parent_span_id == "" and fanned.trace_id != TRACE_ID
    attrs = traced.attributes
    num_prompt = len(engine.get_tokenizer().encode(prompt))
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == "tiny"
    assert (attrs[A.GEN_AI_REQUEST_MAX_TOKENS], attrs[A.GEN_AI_REQUEST_N]) == (5, 1)
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.5)
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert (attrs[A.GEN_AI_USAGE_PROMPT_TOKENS], attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS]) == (num_prompt, 5)
    queue, ttft, e2e = (
        attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE],
        attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN],
        attrs[A.GEN_AI_LATENCY_E2E],
    )
    assert 0 <= queue <= ttft <= e2e
    prefill, decode, inference = (
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL],
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE],
        attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE],
    )
    assert prefill >= 0 and decode > 0 and inference == pytest.approx(prefill + decode, abs=1e-6)
    # The span covers the request's life: arrival to finish.
    assert (traced.end_ns - traced.start_ns) / 1e9 == pytest.approx(e2e, abs=1e-3)
    assert fanned.attributes[A.GEN_AI_REQUEST_N] == 2
    assert fanned.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 6

    # collect_detailed_traces=all: a span per step's forward, nested in that step's execute_model.
    executes = {s.span_id: s for s in collector.named("execute_model")}
    forwards = collector.named("model_forward")
    assert executes and len(forwards) == len(executes)
    assert all(f.parent_span_id in executes for f in forwards)
    assert sum(s.attributes["pagedllm.num_scheduled_tokens"] for s in executes.values()) >= 2 * num_prompt
    assert len(collector.named("sample_tokens")) == len(executes)


def test_detailed_traces_need_an_endpoint() -> None:
    with pytest.raises(ValueError, match="collect_detailed_traces requires `--otlp-traces-endpoint`"):
        ObservabilityConfig(collect_detailed_traces=["model"])
    # vLLM's comma-separated form.
    config = ObservabilityConfig(otlp_traces_endpoint="http://x:4317", collect_detailed_traces=["model,worker"])
    assert config.collect_detailed_traces == ["model", "worker"]


def test_tracing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = observability._find_spec
    monkeypatch.setattr(
        observability, "_find_spec", lambda name: None if name.startswith("opentelemetry.exporter") else real(name)
    )
    with pytest.raises(ValueError, match=r"otlp_traces_endpoint: .*opentelemetry.exporter.otlp.*pagedllm\[otel\]"):
        ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4317")


def test_trace_headers_taken_from_a_request() -> None:
    headers = {"traceparent": TRACEPARENT, "tracestate": "k=v", "authorization": "secret"}
    assert tracing.extract_trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "k=v"}
    assert tracing.extract_trace_headers({"accept": "*/*"}) is None
