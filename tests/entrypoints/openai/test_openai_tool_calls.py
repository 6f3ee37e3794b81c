"""Tool calling through a real server (`--enable-auto-tool-choice --tool-call-parser hermes`) with the
official openai client, sampling at temperature 1.0: named and "required" tool choices give arguments
that validate against the tool's parameters (the grammar holds the model to them), streamed too; "auto"
without a tool call in the output is plain content; a conversation carrying tool calls and tool results
is taken; bad input is a 400 naming the field; bad tool flags stop the server before the model loads."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from remote_server import MODEL_NAME, RemoteServer
from serve_startup import refused_before_the_engine

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    },
    "required": ["city", "days", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Clock", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tool_server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, **fields)


def test_named_tool_choice_arguments_validate(client: openai.OpenAI) -> None:
    response = _create(client, tool_choice=NAMED, temperature=1.0, seed=1, n=2, max_tokens=80)
    for choice in response.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_tool_choice_calls_validate(client: openai.OpenAI) -> None:
    response = _create(client, tool_choice="required", temperature=1.0, seed=2, n=2, max_tokens=150)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


README_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_readme_example_calls_the_tool_greedily(client: openai.OpenAI, tool_choice: Any) -> None:
    """README's tool example: SmolLM2's chat template drops the tools, yet a named or "required"
    choice (which needs no server flag) holds the output to the schema, and greedy it asks for the
    city the user named, in the machine's default dtype."""
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=README_TOOLS,
        tool_choice=tool_choice,
        temperature=0,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def _join_stream(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.index not in calls:
                # The first piece of a call names it.
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize(("tool_choice", "finish_reason"), [(NAMED, "stop"), ("required", "tool_calls")])
def test_streamed_tool_calls_validate(client: openai.OpenAI, tool_choice: Any, finish_reason: str) -> None:
    stream = _create(client, tool_choice=tool_choice, temperature=1.0, seed=3, max_tokens=150, stream=True)
    content, calls, finish = _join_stream(stream)
    assert content == "" and calls and finish == finish_reason
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


NESTED: dict[str, Any] = {
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"enum": ["FR", "NO"]}},
            "required": ["city", "country"],
        }
    },
    "type": "object",
    "properties": {
        "places": {"type": "array", "items": {"$ref": "#/$defs/Place"}, "minItems": 1, "maxItems": 2}
    },
    "required": ["places"],
}


def test_required_tool_with_nested_definitions(client: openai.OpenAI) -> None:
    """Parameters with `$defs`/`$ref` (a pydantic model with a nested model) under tool_choice
    "required": the output is held to them."""
    tools: Any = [{"type": "function", "function": {"name": "visit", "parameters": NESTED}}, TOOLS[1]]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice="required", max_tokens=120, seed=4
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    for call in choice.message.tool_calls or ():
        schema = NESTED if call.function.name == "visit" else TIME
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_without_a_tool_call_is_plain_content(client: openai.OpenAI) -> None:
    greeting = [{"role": "user", "content": "Say hello."}]
    fields: Any = {"model": MODEL_NAME, "messages": greeting, "temperature": 0.0, "max_tokens": 12}
    plain = client.chat.completions.create(**fields)
    auto = client.chat.completions.create(**fields, tools=TOOLS, tool_choice="auto")
    assert "<tool_call>" not in (auto.choices[0].message.content or "")
    assert auto.choices[0].message.tool_calls in (None, [])
    assert auto.choices[0].finish_reason in ("stop", "length")
    assert auto.choices[0].message.content  # the tokens the tools added to the prompt may change the words
    content, calls, _ = _join_stream(client.chat.completions.create(**fields, tools=TOOLS, stream=True))
    assert calls == {} and content == auto.choices[0].message.content
    assert plain.choices[0].message.tool_calls in (None, [])


def test_conversation_with_tool_calls_and_results(client: openai.OpenAI) -> None:
    messages: Any = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2, "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'},
    ]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert response.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
        ({"tools": [], "tool_choice": "required"}, "tools", "at least one tool"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                "tool_choice": "required",
            },
            "tools",
            "tools[].function.parameters is invalid",
        ),
        ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "guided_regex", "cannot be combined"),
        ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls", "boolean"),
        ({"messages": [{"role": "tool", "content": "1"}]}, "messages", "tool_call_id"),
    ],
)
def test_bad_tool_input_is_400_naming_the_field(
    tool_server: RemoteServer, body: dict[str, Any], param: str, words: str
) -> None:
    request = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **body}
    response = httpx.post(f"{tool_server.url}/v1/chat/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tool-call-parser", "qwen9"], "--tool-call-parser 'qwen9' is not a known tool parser"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (["--tool-parser-plugin", "/nonexistent/parser.py"], "is not a file"),
    ],
)
def test_bad_tool_flags_fail_before_loading_the_model(
    flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Status 2 with the message, and the engine is never created. The real process's exit on such a flag
    is test_server_lifecycle.py's bad --chat-template case (the same check, same return)."""
    assert message in refused_before_the_engine(flags, monkeypatch, caplog)
