"""The chat endpoint's tool handling without a model: request checks (400s naming the field), the schemas
of forced tool choices, and the reading of fixed outputs into messages and stream chunks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest

from pagedllm.config.features import ReasoningConfig
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.serving_chat import _stream_tool_calls
from pagedllm.entrypoints.openai.serving_reasoning import ReasoningSplitter
from pagedllm.entrypoints.openai.serving_tools import (
    ToolCallingConfig,
    apply_tool_choice,
    check_tool_request,
    choice_tool_calls,
    load_tool_calling_config,
    tool_schema,
)
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.sampling_params import SamplingParams

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
AUTO = ToolCallingConfig(True, ToolParserManager.get_tool_parser("hermes"))
HERMES_OUTPUT = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather?"}], **fields)


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    ("fields", "config", "words"),
    [
        ({"tool_choice": "required"}, AUTO, "`tools` must be set"),
        ({"tool_choice": _named("get_weather")}, AUTO, "`tools` must be set"),
        ({"tools": TOOLS, "tool_choice": _named("nope")}, AUTO, "'nope' specified in `tool_choice`"),
        ({"tools": TOOLS}, ToolCallingConfig(), "requires --enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, ToolCallingConfig(True, None), "--tool-call-parser"),
    ],
)
def test_bad_tool_choices_name_tool_choice(
    fields: dict[str, Any], config: ToolCallingConfig, words: str
) -> None:
    with pytest.raises(OpenAIError, match=words) as error:
        check_tool_request(_request(**fields), config)
    assert error.value.param == "tool_choice"


def test_a_forced_tool_choice_cannot_take_another_constraint() -> None:
    request = _request(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(
        OpenAIError, match="response_format cannot be combined with tool_choice 'required'"
    ) as e:
        check_tool_request(request, AUTO)
    assert e.value.param == "response_format"


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": TOOLS, "tool_choice": "none"},
        {"tools": [], "tool_choice": "required"},  # OpenAI: like "none"
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": _named("get_time")},
    ],
)
def test_good_requests_need_no_auto_flags(fields: dict[str, Any]) -> None:
    request = _request(**fields)
    check_tool_request(request, ToolCallingConfig())
    assert (choice_tool_calls(request, ToolCallingConfig(), None) is None) == (not request.forces_tool_call())


def test_named_schema_is_the_functions_parameters() -> None:
    assert tool_schema(_request(tools=TOOLS, tool_choice=_named("get_weather"))) == WEATHER
    assert tool_schema(_request(tools=TOOLS, tool_choice=_named("get_time"))) == {
        "type": "object",
        "properties": {},
    }
    assert tool_schema(_request(tools=TOOLS, tool_choice="auto")) is None


def test_required_schema_takes_lists_of_calls_of_the_given_tools() -> None:
    schema = tool_schema(_request(tools=TOOLS, tool_choice="required"))
    assert schema is not None
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        {"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}},
        {"name": "get_time", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_apply_tool_choice_constrains_forced_choices_only() -> None:
    params = SamplingParams()
    apply_tool_choice(_request(tools=TOOLS, tool_choice=_named("get_weather")), params, AUTO, None)
    assert params.structured_outputs is not None and params.structured_outputs.json == WEATHER
    params = SamplingParams()
    apply_tool_choice(_request(tools=TOOLS), params, AUTO, None)
    assert params.structured_outputs is None and params.skip_special_tokens


def test_auto_reads_tool_calls_with_the_parser() -> None:
    tools = choice_tool_calls(_request(tools=TOOLS), AUTO, None)
    assert tools is not None
    content, calls = tools.full(HERMES_OUTPUT)
    assert content == "Checking.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_time", {}),
    ]
    assert tools.finish_reason("stop", True) == "tool_calls"
    assert tools.finish_reason("length", True) == "length"
    assert tools.finish_reason("stop", False) == "stop"


def test_auto_without_tool_calls_is_plain_content() -> None:
    tools = choice_tool_calls(_request(tools=TOOLS), AUTO, None)
    assert tools is not None
    assert tools.full("It is sunny <3") == ("It is sunny <3", [])


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    request = _request(tools=TOOLS, parallel_tool_calls=False)
    tools = choice_tool_calls(request, AUTO, None)
    assert tools is not None
    assert [c.function.name for c in tools.full(HERMES_OUTPUT)[1]] == ["get_weather"]
    stream = choice_tool_calls(request, AUTO, None)
    assert stream is not None
    indexes = {d.index for ch in HERMES_OUTPUT for d in stream.delta(ch, False)[1]}
    assert indexes == {0}


def test_named_and_required_outputs() -> None:
    named = choice_tool_calls(_request(tools=TOOLS, tool_choice=_named("get_weather")), AUTO, None)
    assert named is not None
    content, calls = named.full(' {"city": "Rome", "days": 3}')
    assert content is None and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Rome", "days": 3}
    assert named.finish_reason("stop", True) == "stop"  # as vLLM for a named function
    required = choice_tool_calls(_request(tools=TOOLS, tool_choice="required"), AUTO, None)
    assert required is not None
    content, calls = required.full('[{"name": "get_time", "parameters": {}}]')
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_time", "{}")
    ]
    assert required.finish_reason("stop", True) == "tool_calls"
    # Cut short by max_tokens: no call to give, the text stays as content.
    assert required.full('[{"name": "get_time", "para') == ('[{"name": "get_time", "para', [])


@pytest.mark.parametrize(
    ("fields", "output"),
    [
        ({"tools": TOOLS}, HERMES_OUTPUT),
        ({"tools": TOOLS}, "No tools, just text with a < sign."),
        (
            {"tools": TOOLS, "tool_choice": "required"},
            '[{"name": "get_time", "parameters": {}}, {"name": '
            '"get_weather", "parameters": {"city": "Lyon", "days": 4}}]',
        ),
        ({"tools": TOOLS, "tool_choice": _named("get_weather")}, '{"city": "Nice", "days": 5}'),
    ],
)
def test_stream_chunks_join_to_the_full_message(fields: dict[str, Any], output: str) -> None:
    request = _request(**fields)
    full = choice_tool_calls(request, AUTO, None)
    assert full is not None
    content, calls = full.full(output)
    stream = choice_tool_calls(request, AUTO, None)
    streamed_content, streamed_calls, last_reason = "", {}, None
    pieces = [output[i : i + 3] for i in range(0, len(output), 3)]
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        choice = ChatCompletionStreamChoice(index=0, delta=DeltaMessage(content=piece), finish_reason=finish)
        if not _stream_tool_calls(stream, choice):
            assert finish is None
            continue
        streamed_content += choice.delta.content or ""
        for d in choice.delta.tool_calls or ():
            entry = streamed_calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
        last_reason = choice.finish_reason
    assert (streamed_content or None) == content
    assert [tuple(v) for v in streamed_calls.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert last_reason == full.finish_reason("stop", bool(calls))


def test_server_flags(tmp_path: Path) -> None:
    assert load_tool_calling_config(False, None, None) == ToolCallingConfig()
    assert load_tool_calling_config(True, "pythonic", None).tool_parser is ToolParserManager.get_tool_parser(
        "pythonic"
    )
    with pytest.raises(ValueError, match="--enable-auto-tool-choice requires --tool-call-parser"):
        load_tool_calling_config(True, None, None)
    with pytest.raises(ValueError, match="--tool-call-parser 'qwen9'"):
        load_tool_calling_config(True, "qwen9", None)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager\n"
        "from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser\n"
        "ToolParserManager.register_module('my_hermes')(Hermes2ProToolParser)\n"
    )
    try:
        assert load_tool_calling_config(True, "my_hermes", str(plugin)).tool_parser is not None
    finally:
        ToolParserManager.tool_parsers.pop("my_hermes", None)


def test_reasoning_is_split_off_before_the_tool_parser_reads_the_stream() -> None:
    """A reasoning model's stream: the reasoning deltas are sent (none is dropped as "nothing to send"),
    the tool parser sees only the content after `</think>`, and everything joins to the full message."""
    vocab = SimpleNamespace(get_vocab=lambda: {"<think>": 5, "</think>": 6})
    reasoning = ReasoningSplitter(
        SimpleNamespace(reasoning_config=ReasoningConfig(reasoning_parser="qwen3")), vocab
    )
    request = _request(tools=TOOLS)
    output = "<think>Which tool? The weather one.</think>" + HERMES_OUTPUT
    message = reasoning.for_request(request).message(output)
    full = choice_tool_calls(request, AUTO, None)
    assert full is not None
    content, calls = full.full(message.content or "")
    stream, split = choice_tool_calls(request, AUTO, None), reasoning.for_request(request)
    streamed_reasoning, streamed_content, names = "", "", []
    pieces = [output[i : i + 4] for i in range(0, len(output), 4)]
    for i, piece in enumerate(pieces):
        finish = "stop" if i == len(pieces) - 1 else None
        choice = ChatCompletionStreamChoice(index=0, delta=split.delta(0, piece, finish is not None))
        choice.finish_reason = finish
        if not _stream_tool_calls(stream, choice):
            continue
        streamed_reasoning += choice.delta.reasoning_content or ""
        streamed_content += choice.delta.content or ""
        names += [d.function.name for d in choice.delta.tool_calls or () if d.function.name]
    assert streamed_reasoning == message.reasoning_content == "Which tool? The weather one."
    assert (streamed_content or None) == content == "Checking.\n"
    assert names == [c.function.name for c in calls] == ["get_weather", "get_time"]
