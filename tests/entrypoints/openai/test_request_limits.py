"""Request size bounds (each a 400 naming the field), `--request-limit` overrides, the logit bias clamp and
strict booleans, with no server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedllm.entrypoints.openai.request_limits import SIZE_LIMITS, RequestLimits, parse_request_limits

LIMITS = RequestLimits()


def _tool(name: str, properties: int = 1) -> dict[str, Any]:
    params = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}
    return {"type": "function", "function": {"name": name, "parameters": params}}


# (field, a value just within the default limit, one just over it); the limit named as the field unless
# given as a fourth item.
SAMPLING_CASES: list[tuple[Any, ...]] = [
    ("stop", ["s"] * 64, ["s"] * 65),
    ("stop", "x" * 1024, "x" * 1025, "stop_chars"),
    ("stop", ["x" * 1024], ["ok", "x" * 1025], "stop_chars"),
    ("stop_token_ids", list(range(128)), list(range(129))),
    ("logit_bias", {str(i): 1.0 for i in range(1024)}, {str(i): 1.0 for i in range(1025)}),
    ("allowed_token_ids", list(range(1024)), list(range(1025))),
    ("bad_words", ["w"] * 128, ["w"] * 129),
]


@pytest.mark.parametrize("case", SAMPLING_CASES, ids=lambda c: f"{c[0]}-{c[-1] if len(c) > 3 else 'count'}")
def test_sampling_field_sizes(case: tuple[Any, ...]) -> None:
    field, within, over = case[:3]
    name = case[3] if len(case) > 3 else field
    LIMITS.check_sampling(CompletionRequest(prompt="x", **{field: within}))
    with pytest.raises(OpenAIError) as error:
        LIMITS.check_sampling(CompletionRequest(prompt="x", **{field: over}))
    assert error.value.param == field
    assert str(SIZE_LIMITS[name].default) in error.value.message
    assert f"--request-limit {name}=N" in error.value.message
    # The operator's override moves the bound.
    RequestLimits(overrides={name: 10_000}).check_sampling(CompletionRequest(prompt="x", **{field: over}))


def test_chat_messages_and_tools() -> None:
    messages = [{"role": "user", "content": "hi"}]
    chat = ChatCompletionRequest(messages=messages * 2049, tools=[_tool(f"f{i}") for i in range(129)])
    with pytest.raises(OpenAIError) as error:
        LIMITS.check_count("messages", chat.messages)
    assert (error.value.param, "2049 messages" in error.value.message) == ("messages", True)
    LIMITS.check_count("messages", chat.messages[:2048])
    with pytest.raises(OpenAIError) as error:
        LIMITS.check_tools(chat.tools)
    assert error.value.param == "tools" and "129 tools" in error.value.message
    LIMITS.check_tools(chat.tools[:128])
    # One tool's definition over 64 KiB of JSON (a schema with thousands of properties).
    big = ChatCompletionRequest(messages=messages, tools=[_tool("small"), _tool("huge", properties=3000)])
    with pytest.raises(OpenAIError) as error:
        LIMITS.check_tools(big.tools)
    assert error.value.param == "tools" and "'huge'" in error.value.message
    assert "tool_bytes" in error.value.message


def test_parse_request_limits() -> None:
    assert parse_request_limits(["messages=4096", "input=10"]) == {"messages": 4096, "input": 10}
    assert parse_request_limits(None) == {}
    for bad in ("messages", "frobs=3", "messages=many", "messages=0"):
        with pytest.raises(ValueError, match="--request-limit"):
            parse_request_limits([bad])
    limits = RequestLimits(overrides=parse_request_limits(["prompt=2"]))
    with pytest.raises(OpenAIError, match="prompt has 3 prompts, more than this server's limit of 2"):
        limits.check_count("prompt", ["a", "b", "c"])


def test_logit_bias_is_clamped_to_openai_range() -> None:
    request = CompletionRequest(prompt="x", logit_bias={"1": 1e9, "2": -250.0, "3": 7.5})
    assert request.to_sampling_params().logit_bias == {1: 100.0, 2: -100.0, 3: 7.5}
    # Non-finite values are still refused (not clamped into a valid-looking bias).
    with pytest.raises(ValueError, match="finite"):
        CompletionRequest(prompt="x", logit_bias={"1": float("inf")}).to_sampling_params()


@pytest.mark.parametrize("value", ["yes", "true", 1, "on"])
def test_stream_must_be_a_json_boolean(value: object) -> None:
    with pytest.raises(ValidationError, match="stream"):
        CompletionRequest(prompt="x", stream=value)
    with pytest.raises(ValidationError, match="stream"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=value)
    assert CompletionRequest(prompt="x", stream=True).stream is True
