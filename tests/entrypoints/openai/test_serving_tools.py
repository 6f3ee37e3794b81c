"""The chat endpoint's tool handling without a model: request checks (400s naming the field), the schemas
of forced tool choices, and the reading of fixed outputs into messages and stream chunks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError
from tiny_llm import build_tokenizer

from pagedllm.config.features import ReasoningConfig
from pagedllm.config.structured_outputs import StructuredOutputsConfig
from pagedllm.entrypoints.openai.errors import OpenAIError, validation_error
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionRequest,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
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
from pagedllm.entrypoints.openai.serving_utils import sse
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.backends import resolve_backend
from pagedllm.structured_output.bitmask import forbidden_tokens
from pagedllm.structured_output.manager import StructuredOutputManager

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


def test_required_schema_takes_one_call_without_parallel_tool_calls() -> None:
    schema = tool_schema(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False))
    assert schema is not None
    one = [{"name": "get_time", "parameters": {}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)


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


@pytest.mark.parametrize("choice", ["required", "auto", _named("get_weather")])
def test_tool_choice_without_tools_is_refused_at_validation(choice: Any) -> None:
    """vLLM's message, from the request model itself (a 400 naming tool_choice over HTTP)."""
    with pytest.raises(ValidationError) as e:
        _request(tool_choice=choice)
    error = validation_error(e.value)
    assert error.param == "tool_choice"
    assert "When using `tool_choice`, `tools` must be set." in error.message
    _request(tool_choice="none")  # needs no tools


def test_required_with_an_empty_tool_list_is_refused() -> None:
    with pytest.raises(OpenAIError, match='"required" needs at least one tool') as e:
        check_tool_request(_request(tools=[], tool_choice="required"), AUTO)
    assert e.value.param == "tools"


def _sent_chunks(request: ChatCompletionRequest, output: str, size: int, finish: str = "stop") -> list[Any]:
    """The JSON of each chunk the stream sends for `output`, arriving `size` characters at a time."""
    config = ToolCallingConfig(True, ToolParserManager.get_tool_parser(PARSER_OF.get(output, "hermes")))
    stream = choice_tool_calls(request, config, None)
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    sent = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        choice = ChatCompletionStreamChoice(
            index=0, delta=DeltaMessage(content=piece), finish_reason=finish if last else None
        )
        if _stream_tool_calls(stream, choice):
            chunk = ChatCompletionStreamResponse(id="chatcmpl-1", model="m", choices=[choice])
            sent.append(json.loads(sse(chunk).removeprefix("data: ")))
    return sent


PYTHONIC_OUTPUT = '[get_weather(city="Paris", days=2), get_time()]'
PARSER_OF = {PYTHONIC_OUTPUT: "pythonic"}
REQUIRED_OUTPUT = '[{"name": "get_weather", "parameters": {"city": "Lyon", "days": 4}}, {"name": "get_time", "parameters": {}}]'


def _has_null(value: Any) -> bool:
    if isinstance(value, dict):
        return any(v is None or _has_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_null(v) for v in value)
    return False


@pytest.mark.parametrize("size", [1, 3, 10_000])
@pytest.mark.parametrize(
    ("fields", "output"),
    [
        ({"tools": TOOLS}, HERMES_OUTPUT),
        ({"tools": TOOLS}, PYTHONIC_OUTPUT),
        ({"tools": TOOLS, "tool_choice": "required"}, REQUIRED_OUTPUT),
        ({"tools": TOOLS, "tool_choice": _named("get_weather")}, '{"city": "Nice", "days": 5}'),
    ],
)
def test_streamed_tool_call_entries_have_openais_shape(
    fields: dict[str, Any], output: str, size: int
) -> None:
    """Per chunk at most one entry per call index; a call's first entry carries id, type, name and the
    arguments as a string; the later ones only argument fragments; no field is sent as null (clients do
    `arguments += delta.function.arguments`)."""
    seen: set[int] = set()
    arguments: dict[int, str] = {}
    for chunk in _sent_chunks(_request(**fields), output, size):
        delta = chunk["choices"][0]["delta"]
        assert not _has_null(delta), delta
        entries = delta.get("tool_calls", [])
        assert len({e["index"] for e in entries}) == len(entries), entries
        for entry in entries:
            if entry["index"] not in seen:
                seen.add(entry["index"])
                assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
                assert set(entry["function"]) == {"name", "arguments"} and entry["function"]["name"]
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
            assert isinstance(entry["function"]["arguments"], str)
            arguments[entry["index"]] = arguments.get(entry["index"], "") + entry["function"]["arguments"]
    assert seen and all(isinstance(json.loads(a), dict) for a in arguments.values())


@pytest.mark.parametrize(
    ("fields", "output", "content"),
    [
        (
            {"tools": TOOLS, "tool_choice": "required"},
            '[{"name": "get_weather", "parameters": {"city": "Os',
            "",
        ),
        (
            {"tools": TOOLS},
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci',
            "Checking.\n",
        ),
    ],
)
def test_a_call_cut_by_max_tokens_ends_with_the_deltas_already_sent(
    fields: dict[str, Any], output: str, content: str
) -> None:
    """The final chunk does not re-send the raw output as content after the tool-call deltas."""
    for size in (2, 7):
        chunks = _sent_chunks(_request(**fields), output, size, finish="length")
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content", "") for d in deltas) == content
        assert [
            e["function"]["name"] for d in deltas for e in d.get("tool_calls", []) if "name" in e["function"]
        ] == ["get_weather"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


class Address(BaseModel):
    city: str
    zip_code: str


class Person(BaseModel):
    name: str
    home: Address
    previous: list[Address] = []


def _parcel_schema() -> dict[str, Any]:
    class Address(BaseModel):  # the same definition name as Person's, another shape
        street: str

    class Parcel(BaseModel):
        to: Address
        weight: int

    return Parcel.model_json_schema()


def test_required_schema_hoists_each_tools_definitions() -> None:
    """Tool parameters with `$defs`/`$ref` (every pydantic model with a nested model): each tool's refs
    still reach its own definitions once its schema sits inside the "required" list's anyOf."""
    tools = [
        {"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}},
        {"type": "function", "function": {"name": "send", "parameters": _parcel_schema()}},
    ]
    schema = tool_schema(_request(tools=tools, tool_choice="required"))
    assert schema is not None
    jsonschema.Draft202012Validator.check_schema(schema)
    person = {"name": "Ada", "home": {"city": "Oslo", "zip_code": "0150"}}
    parcel = {"to": {"street": "Main St"}, "weight": 2}
    jsonschema.validate(
        [{"name": "add_person", "parameters": person}, {"name": "send", "parameters": parcel}], schema
    )
    for bad in (
        [{"name": "add_person", "parameters": {"name": "Ada", "home": {"street": "Main St"}}}],
        [{"name": "send", "parameters": {"to": {"city": "Oslo", "zip_code": "1"}, "weight": 2}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    params = SamplingParams()
    apply_tool_choice(_request(tools=tools, tool_choice="required"), params, AUTO, None)
    assert params.structured_outputs is not None
    assert resolve_backend(params.structured_outputs, "xgrammar", True) == "xgrammar"  # compiles


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize(
    ("choice", "prefixes"),
    [("required", ["[", "[{", '[{"name"']), (_named("get_weather"), ["", "{", '{"city"'])],
)
def test_forced_tool_grammars_admit_no_free_whitespace(
    tokenizer: Any, backend: str, choice: Any, prefixes: list[str]
) -> None:
    """Between JSON tokens the grammar allows no whitespace token, where a small model could wander."""
    params = SamplingParams()
    apply_tool_choice(_request(tools=TOOLS, tool_choice=choice), params, AUTO, None)
    constraint = params.structured_outputs
    assert constraint is not None
    config = StructuredOutputsConfig(backend=backend, disable_fallback=True)
    manager = StructuredOutputManager(config, len(tokenizer), [tokenizer.eos_token_id], lambda: tokenizer)
    constraint.resolved_backend = resolve_backend(constraint, backend, True)
    whitespace = {i for i in range(len(tokenizer)) if tokenizer.decode([i]) in (" ", "\n", "  ", "\t", " \n")}
    assert whitespace
    for prefix in prefixes:
        grammar = manager.grammar_init(constraint, [])
        while not grammar.is_ready():
            time.sleep(0.01)
        grammar.init_matcher()
        for token in tokenizer.encode(prefix):
            assert grammar.accept_token(token)
        allowed = ~forbidden_tokens(manager.grammar_bitmask([grammar]), len(tokenizer))
        assert not whitespace & {int(i) for i in allowed.nonzero()[-1]}, prefix
