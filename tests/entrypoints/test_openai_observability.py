"""Tracing, request logs and stream_interval through a real server and the official client."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest
from otlp_collector import SERVER_KIND, OTLPCollector
from remote_server import MODEL_NAME, RemoteServer

from pagedllm.metrics.tracing import SpanAttributes as A

pytestmark = pytest.mark.slow

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
STREAM_INTERVAL = 4
MAX_LOG_LEN = 12
PROMPT = "The capital of France is a city that"


@pytest.fixture(scope="module")
def collector() -> Iterator[OTLPCollector]:
    server = OTLPCollector()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def server(collector: OTLPCollector) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        extra_args=[
            "--otlp-traces-endpoint",
            collector.url,
            "--enable-log-requests",
            "--max-log-len",
            str(MAX_LOG_LEN),
            "--stream-interval",
            str(STREAM_INTERVAL),
        ],
        # The in-process collector speaks OTLP over HTTP; export every 100 ms rather than every 5 s.
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    try:
        yield remote
    finally:
        remote.kill()


def test_span_per_request_with_the_callers_trace_as_parent(
    client: openai.OpenAI, collector: OTLPCollector
) -> None:
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        top_p=0.8,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": traceparent},
    )
    [span] = [
        s for s in collector.wait_for("llm_request", 1) if s.attributes[A.GEN_AI_REQUEST_ID] == completion.id
    ]
    assert span.kind == SERVER_KIND
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_ID)
    attrs = span.attributes
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == MODEL_NAME
    assert (attrs[A.GEN_AI_REQUEST_MAX_TOKENS], attrs[A.GEN_AI_REQUEST_N]) == (6, 1)
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.8)
    assert completion.usage is not None
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == completion.usage.prompt_tokens
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == completion.usage.completion_tokens == 6
    assert 0 <= attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE] <= attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    assert attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= attrs[A.GEN_AI_LATENCY_E2E]
    for name in (
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE,
    ):
        assert attrs[name] >= 0


def test_stream_interval_fewer_chunks_same_text(client: openai.OpenAI) -> None:
    max_tokens = 13
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}
    whole = client.completions.create(**request, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(**request, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole
    # The first token, then every STREAM_INTERVAL tokens, then the rest with the finish reason: every
    # token on its own would be 17 chunks.
    assert len(chunks) <= 1 + math.ceil((max_tokens - 1) / STREAM_INTERVAL)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_request_log_truncated(client: openai.OpenAI, server: RemoteServer) -> None:
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0)
    text = completion.choices[0].text
    log = server.log_text()
    assert f"Received request {completion.id}: prompt: {PROMPT[:MAX_LOG_LEN]!r}, params: " in log
    assert f"Generated response {completion.id}: output: {text[:MAX_LOG_LEN]!r}, output_token_ids: [" in log
