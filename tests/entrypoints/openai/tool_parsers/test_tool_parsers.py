"""Each built-in tool parser on fixed model texts: the complete reading, and the same text streamed token
by token (the embedded SmolLM2 tokenizer) and character by character, whose joined deltas must equal the
complete reading (content, names and arguments)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.openai.protocol_chat import ChatCompletionToolsParam
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
    (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
        [],
    ),
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
    # A call inside text (Llama 3.x often explains around it): found, and the text stays content.
    (
        "llama3_json",
        'Here is the result: {"name": "get_weather", "parameters": '
        + json.dumps(WEATHER)
        + "} Hope it helps!",
        "Here is the result:  Hope it helps!",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '{"type": "function", "name": "get_time", "parameters": {}}\n\nAnything else?',
        "\n\nAnything else?",
        [("get_time", {})],
    ),
    (
        "llama3_json",
        "Code: if (x) { y(); } then",
        "Code: if (x) { y(); } then",
        [],
    ),
    # An object without parameters/arguments is not a call of a function named "Alice".
    ("llama3_json", '{"name": "Alice", "age": 30}', '{"name": "Alice", "age": 30}', []),
    (
        "llama3_json",
        'Use {"name": "x"} or {"name": "get_time", "arguments": {"zone": "}"}}',
        'Use {"name": "x"} or ',
        [("get_time", {"zone": "}"})],
    ),
    # Granite 3.0 (special token) and 3.1+ (text marker).
    (
        "granite",
        '<|tool_call|>[{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}, {"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "granite",
        ' <tool_call>[{"name": "get_time", "arguments": {"zone": "JST"}}]',
        None,
        [("get_time", {"zone": "JST"})],
    ),
    ("granite", "The weather is [unknown].", "The weather is [unknown].", []),
    (
        "granite",
        '<tool_call>[{"name": "get_time", "arguments": {"zone": "J',
        '<tool_call>[{"name": "get_time", "arguments": {"zone": "J',
        [],
    ),
    (
        "jamba",
        'Let me check. <tool_calls>[{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + "}]</tool_calls>",
        "Let me check. ",
        [("get_weather", WEATHER)],
    ),
    ("jamba", "No <tools> here.", "No <tools> here.", []),
    (
        "internlm",
        "I will look it up.<|action_start|><|plugin|>\n"
        '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}<|action_end|>\n",
        "I will look it up.",
        [("get_weather", WEATHER)],
    ),
    ("internlm", "Just text <|action", "Just text <|action", []),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + json.dumps(WEATHER)
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "deepseek_v31",
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        '{"zone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Checking.",
        [("get_time", {"zone": "UTC"})],
    ),
    (
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, FR\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n</function>\n</tool_call>",
        "I'll check.\n",
        [("get_weather", {"city": "Paris, FR", "unit": "celsius"}), ("get_time", {})],
    ),
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
    # Text after the call list is content.
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + "}] Let me know if you need more.",
        "Sure.  Let me know if you need more.",
        [("get_weather", WEATHER)],
    ),
    # Several markers: every group's calls.
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": '
        + json.dumps(WEATHER)
        + '}][TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    # Tokenizer v11+ (Mistral Small 3.2, Magistral): name[ARGS]{...} after each marker.
    (
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]{}",
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("mistral", '[TOOL_CALLS]get_time{"zone": "UTC"}', None, [("get_time", {"zone": "UTC"})]),
    # Junk between the marker and the calls is dropped; the calls are found.
    (
        "mistral",
        '[TOOL_CALLS] here you go: [{"name": "get_time", "arguments": {"zone": "CET"}}] done',
        " done",
        [("get_time", {"zone": "CET"})],
    ),
    # Not calls after the marker: content, without the marker.
    ("mistral", "Hmm. [TOOL_CALLS] not json", "Hmm.  not json", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, oops]',
        ' [{"name": "f", "arguments": {"a": 1}}, oops]',
        [],
    ),
    (
        "pythonic",
        '[get_weather(city="Paris, FR", days=[1, 2], unit=\'celsius\', note="say \\"hi\\" } ]"), get_time()]',
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    # openai (harmony, gpt-oss): the analysis channel is reasoning, a message to functions.NAME a call,
    # the final channel the content; the stop token <|call|> / <|return|> may be cut from the text.
    (
        "openai",
        "<|channel|>analysis<|message|>User wants the weather in Paris. Use get_weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + json.dumps(WEATHER)
        + "<|call|>",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>Need the time.<|end|>"
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}",
        None,
        [("get_time", {})],
    ),
    (
        "openai",
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
        "<|start|>assistant<|channel|>commentary to=functions.g <|constrain|>json<|message|>{}<|call|>",
        None,
        [("f", {"a": 1}), ("g", {})],
    ),
    (
        "openai",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
        "It is sunny in Paris.<|return|>",
        "It is sunny in Paris.",
        [],
    ),
    ("openai", "<|channel|>final<|message|>Hi <|en", "Hi <|en", []),
    ("openai", "Plain answer, no header.", "Plain answer, no header.", []),
    (
        "openai",
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": }<|call|>',
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": }<|call|>',
        [],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "Plain (answer).", "Plain (answer).", []),
]


def _complete(parser: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    info = ToolParserManager.get_tool_parser(parser)().extract_tool_calls(text)
    assert info.tools_called == bool(info.tool_calls)
    for call in info.tool_calls:
        assert call.id and call.type == "function"
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
                assert d.id and d.type == "function" and d.function.name
                assert d.index == len(calls)
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
            assert isinstance(d.function.arguments, str)
            calls[d.index][1] += d.function.arguments
    return content or None, [(name, args) for name, args in calls.values()]


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf: Path) -> Any:
    return get_tokenizer(smollm2_gguf)


def _token_pieces(tokenizer: Any, text: str) -> list[str]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, before = [], ""
    for i in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:i])
        if now.endswith("\ufffd") and i < len(ids):
            continue  # a character split across tokens: the detokenizer waits for the rest
        pieces.append(now[len(before) :])
        before = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_complete_text(parser: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    got_content, got_calls = _complete(parser, text)
    assert got_content == content
    assert [(name, json.loads(args)) for name, args in got_calls] == calls


# Outputs that turn out malformed after their first call was streamed: the stream cannot take it back.
STREAMED_THEN_MALFORMED = ('a": }', "oops]", '{"zone": "J')


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [c for c in CASES if not any(m in c[1] for m in STREAMED_THEN_MALFORMED)],
)
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
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "f", '{"a')]
    content, deltas = parser.extract_tool_calls_streaming(text + '": 1', False)
    assert [(d.index, d.id, d.function.name, d.function.arguments) for d in deltas] == [
        (0, None, None, '": 1')
    ]


def test_special_markers_keep_special_tokens() -> None:
    class Tokenizer:
        all_special_tokens = ["[TOOL_CALLS]", "</s>"]

    assert ToolParserManager.get_tool_parser("mistral")(Tokenizer()).keeps_special_tokens()
    assert not ToolParserManager.get_tool_parser("hermes")(Tokenizer()).keeps_special_tokens()

    class HarmonyTokenizer:
        all_special_tokens = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]

    assert ToolParserManager.get_tool_parser("openai")(HarmonyTokenizer()).keeps_special_tokens()


def test_unknown_parser_names_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser 'nope'.*hermes.*llama3_json.*mistral.*pythonic"):
        ToolParserManager.get_tool_parser("nope")


def test_mistral_tool_call_ids_are_nine_alphanumerics() -> None:
    """Mistral's chat templates refuse other ids when the assistant turn comes back in the next request."""
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    parser_cls = ToolParserManager.get_tool_parser("mistral")
    ids = [c.id for c in parser_cls().extract_tool_calls(text).tool_calls]
    ids += [d.id for d in parser_cls().extract_tool_calls_streaming(text, True)[1] if d.id]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids), ids
    hermes = ToolParserManager.get_tool_parser("hermes")().extract_tool_calls(
        '<tool_call>{"name": "a", "arguments": {}}'
    )
    assert hermes.tool_calls[0].id.startswith("chatcmpl-tool-")


QWEN3_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "plan_trip",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "budget": {"type": "number"},
                    "flexible": {"type": "boolean"},
                    "stops": {"type": "array", "items": {"type": "string"}},
                    "prefs": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "code": {"type": "string"},
                },
            },
        },
    }
]
# Qwen3-Coder's output for a call of plan_trip: every value is text, typed by the tool's schema.
QWEN3_CODER_OUTPUT = (
    "<tool_call>\n<function=plan_trip>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n<parameter=budget>\n1250.5\n</parameter>\n<parameter=flexible>\nTrue\n</parameter>\n"
    "<parameter=stops>\n[\"Boston\", \"DC\"]\n</parameter>\n<parameter=prefs>\n{'hotel': 4, 'view': True}\n"
    "</parameter>\n<parameter=note>\nnull\n</parameter>\n<parameter=code>\ndef f():\n    return 1 < 2\n"
    "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>"
)
QWEN3_CODER_ARGUMENTS = {
    "city": "New York",
    "days": 3,
    "budget": 1250.5,
    "flexible": True,
    "stops": ["Boston", "DC"],
    "prefs": {"hotel": 4, "view": True},
    "note": None,
    "code": "def f():\n    return 1 < 2",
    "extra": "42",  # not in the schema: a string, as vLLM
}


def _qwen3_coder(tokenizer: Any = None) -> ToolParser:
    parser = ToolParserManager.get_tool_parser("qwen3_xml")(tokenizer)
    parser.tools = [ChatCompletionToolsParam.model_validate(t) for t in QWEN3_TOOLS]
    return parser


def test_qwen3_coder_types_parameters_by_the_tool_schema(tokenizer: Any) -> None:
    info = _qwen3_coder().extract_tool_calls(QWEN3_CODER_OUTPUT)
    assert info.content is None
    [call] = info.tool_calls
    assert call.function.name == "plan_trip" and json.loads(call.function.arguments) == QWEN3_CODER_ARGUMENTS
    for pieces in (_token_pieces(tokenizer, QWEN3_CODER_OUTPUT), list(QWEN3_CODER_OUTPUT)):
        content, calls = _streamed(_qwen3_coder(tokenizer), pieces)
        assert content is None and calls == [("plan_trip", call.function.arguments)]


def test_qwen3_coder_output_cut_inside_a_parameter() -> None:
    """Cut by max_tokens: the parameters read so far, the last one as far as it goes (as vLLM)."""
    info = _qwen3_coder().extract_tool_calls(
        "<tool_call>\n<function=plan_trip>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nOs"
    )
    assert json.loads(info.tool_calls[0].function.arguments) == {"days": 2, "city": "Os"}


def test_llama3_json_streams_braces_in_prose_at_once() -> None:
    """Only what may be a JSON object is held back; a brace in code or prose streams on."""
    parser = ToolParserManager.get_tool_parser("llama3_json")()
    assert parser.extract_tool_calls_streaming("Code: if (x) { y(); ", False) == ("Code: if (x) { y(); ", [])
    assert parser.extract_tool_calls_streaming('Code: if (x) { y(); } and {"na', False) == ("} and ", [])
