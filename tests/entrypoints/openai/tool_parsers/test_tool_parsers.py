"""Each built-in tool parser on fixed model texts: the complete reading, and the same text streamed token
by token (the embedded SmolLM2 tokenizer) and character by character, whose joined deltas must equal the
complete reading (content, names and arguments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedllm.tokenizer import get_tokenizer

WEATHER = {"city": "Paris, FR", "days": [1, 2], "unit": "celsius", "note": 'say "hi" } ]'}

# (parser, model output, expected content, expected [(name, arguments as a dict)])
CASES: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("hermes", "No tools needed: 2 < 3 <tool", "No tools needed: 2 < 3 <tool", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>', None, []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("llama3_json", ' {"name": "f", "arguments": {"a": [1]}}', None, [("f", {"a": [1]})]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": {}}]',
        "Sure. ",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    ("mistral", "Use [TOOL] tags.", "Use [TOOL] tags.", []),
    (
        "pythonic",
        '[get_weather(city="Paris, FR", days=[1, 2], unit=\'celsius\', note="say \\"hi\\" } ]"), get_time()]',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "Plain (answer).", "Plain (answer).", []),
]


def _complete(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = ToolParserManager.get_tool_parser(parser)().extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    for call in info.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    return info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Join the deltas of a stream as an OpenAI client does; check each call starts with id and name."""
    content = ""
    calls: dict[int, list[str]] = {}
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        delta, tool_deltas = parser.extract_tool_calls_streaming(text, i == len(pieces) - 1)
        content += delta or ""
        for d in tool_deltas:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments is None
                assert d.index == len(calls)
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
    return content or None, [(name, args) for name, args in calls.values()]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


def _token_pieces(tokenizer: Any, text: str) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        pieces.append(now[len(before) :])
        before = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_complete_text(parser: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got_calls = _complete(parser, text)
    assert got_content == (content if calls else text)
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [c for c in CASES if 'a": }' not in c[1]])
def test_streamed_deltas_join_to_the_complete_reading(
    parser: str, text: str, content: str | None, calls: list[Any], tokenizer: Any
) -> None:
    complete = _complete(parser, text)
    parser_cls = ToolParserManager.get_tool_parser(parser)
    assert _streamed(parser_cls(tokenizer), _token_pieces(tokenizer, text)) == complete
    assert _streamed(parser_cls(tokenizer), list(text)) == complete


def test_stream_holds_back_a_possible_marker_and_sends_the_name_first() -> None:
    parser = ToolParserManager.get_tool_parser("hermes")()
    assert parser.extract_tool_calls_streaming("Hi <tool", False) == ("Hi ", [])
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a'
    content, deltas = parser.extract_tool_calls_streaming(text, False)
    assert content is None
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "f", None),
        (0, None, '{"a'),
    ]


def test_special_markers_keep_special_tokens() -> None:
    class Tokenizer:
        all_special_tokens = ["[TOOL_CALLS]", "</s>"]

    assert ToolParserManager.get_tool_parser("mistral")(Tokenizer()).keeps_special_tokens()
    assert not ToolParserManager.get_tool_parser("hermes")(Tokenizer()).keeps_special_tokens()


def test_unknown_parser_names_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'.*hermes.*llama3_json.*mistral.*pythonic"):
        ToolParserManager.get_tool_parser("nope")
