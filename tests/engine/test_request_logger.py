"""RequestLogger: vLLM's request log lines, texts and token lists cut to max_log_len exactly."""

from __future__ import annotations

import logging

import pytest

from pagedllm.engine.request_logger import RequestLogger
from pagedllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("max_log_len", "prompt", "ids"),
    [(None, "Hello, world", [1, 2, 3, 4, 5]), (3, "Hel", [1, 2, 3]), (0, "", [])],
)
def test_inputs_and_outputs_cut_to_max_log_len(
    caplog: pytest.LogCaptureFixture, max_log_len: int | None, prompt: str, ids: list[int]
) -> None:
    request_logger = RequestLogger(max_log_len)
    params = SamplingParams(max_tokens=7)
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.request_logger"):
        request_logger.log_inputs("r1", "Hello, world", (1, 2, 3, 4, 5), params)
        request_logger.log_inputs("r2", None, None, params)
        request_logger.log_outputs("r1", "Hello, world", [1, 2, 3, 4, 5], "stop")
    assert [r.getMessage() for r in caplog.records] == [
        f"Received request r1: prompt: {prompt!r}, params: {params}, prompt_token_ids: {ids}.",
        f"Received request r2: prompt: None, params: {params}, prompt_token_ids: None.",
        f"Generated response r1: output: {prompt!r}, output_token_ids: {ids}, finish_reason: stop",
    ]
