"""The reasoning parsers on fixed model texts: the complete split, and the same text streamed in every
way a detokenizer could cut it (character by character, and by real tokens), whose joined deltas must
equal the complete split; the registry; `is_reasoning_end` on token ids."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_llm import build_tokenizer

from pagedllm.reasoning import ReasoningParser, get_reasoning_parser, reasoning_parser_names


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


VOCAB = {"<think>": 7, "</think>": 8, "a": 1, "b": 2}

# (parser, chat_template_kwargs, output, reasoning, content)
CASES = [
    (
        "deepseek_r1",
        None,
        "<think>Let me think.</think>The answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    # R1's template opens <think> in the prompt: the output starts inside the reasoning.
    ("deepseek_r1", None, "2 and 2 make 4.\n</think>\n\nIt is 4.", "2 and 2 make 4.\n", "\n\nIt is 4."),
    ("deepseek_r1", None, "still thinking </thi", "still thinking </thi", None),  # cut off
    ("deepseek_r1", None, "<thi", "<thi", None),
    ("deepseek_r1", None, "a</think>", "a", None),
    ("deepseek_r1", None, "x </think> y </think> z", "x ", " y </think> z"),
    ("qwen3", None, "<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "\n\nHello!"),
    # Qwen3-Thinking-2507 / Qwen3.5 open <think> in the prompt: the output starts inside the reasoning.
    ("qwen3", None, "Thinking-2507 style.\n</think>\n\nHello!", "Thinking-2507 style.\n", "\n\nHello!"),
    ("qwen3", None, "cut off before the end", "cut off before the end", None),
    ("qwen3", None, "<thinking about it>", "<thinking about it>", None),
    ("qwen3", None, "<think>cut off mid-tho", "cut off mid-tho", None),
    ("qwen3", None, "x </think> y </think> z", "x ", " y </think> z"),
    # A tool call ends the reasoning (Qwen3.5 may call without closing its thoughts): it is content.
    (
        "qwen3",
        "",
        "Weather first.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        "Weather first.\n",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    ),
    (
        "qwen3",
        None,
        'Call it.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
        "Call it.",
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
    ),
    # A mention of the tag is not a call.
    ("qwen3", None, "I could use <tool_call> tags.</think>No.", "I could use <tool_call> tags.", "No."),
    ("qwen3", None, "cut at <tool_call>", "cut at <tool_call>", None),
    ("qwen3", {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", {"enable_thinking": False}, "Plain answer.", None, "Plain answer."),
    ("qwen3", {"enable_thinking": True}, "<think>x</think>y", "x", "y"),
    # Empty reasoning is "" (as vLLM sends it), not absent.
    ("qwen3", None, "", "", None),
    ("qwen3", None, "<think>\n\n</think>\n\nHi", "\n\n", "\n\nHi"),
    ("deepseek_r1", None, "<think></think>4", "", "4"),
    # <think> after leading whitespace is still the marker: it does not leak into the reasoning.
    ("deepseek_r1", None, "\n\n<think>Hmm.</think>4", "Hmm.", "4"),
    ("deepseek_r1", None, " <thinking>", " <thinking>", None),
]


def make(name: str, kwargs: dict | str | None = None) -> ReasoningParser:
    return get_reasoning_parser(name)(VOCAB, kwargs or None)


def stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content, text = [], [], ""
    for i, piece in enumerate(pieces):
        delta = parser.extract_reasoning_content_streaming(text, text + piece, finished=i == len(pieces) - 1)
        text += piece
        if delta is not None:
            reasoning.append(delta.reasoning or "")
            content.append(delta.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize(("name", "kwargs", "output", "reasoning", "content"), CASES)
def test_complete_split(name: str, kwargs: dict | None, output: str, reasoning: str, content: str) -> None:
    assert make(name, kwargs).extract_reasoning_content(output) == (reasoning, content)


@pytest.mark.parametrize(("name", "kwargs", "output", "reasoning", "content"), CASES)
def test_streamed_deltas_join_to_the_complete_split(
    tokenizer: Any, name: str, kwargs: dict | None, output: str, reasoning: str, content: str
) -> None:
    expected = (reasoning or "", content or "")
    # Character by character: every cut a marker can be split by.
    assert stream(make(name, kwargs), list(output) or [""]) == expected
    # Token by token through a real BPE tokenizer (markers split into several tokens).
    pieces = [tokenizer.decode([t]) for t in tokenizer.encode(output)] or [""]
    assert "".join(pieces) == output
    assert stream(make(name, kwargs), pieces) == expected
    # In one piece.
    assert stream(make(name, kwargs), [output]) == expected


def test_partial_markers_are_held_back_until_decided() -> None:
    parser = make("deepseek_r1")
    delta = parser.extract_reasoning_content_streaming("", "abc</th")
    assert delta is not None and delta.reasoning == "abc" and delta.content is None
    # The tail turned out not to be the marker: it is reasoning after all.
    delta = parser.extract_reasoning_content_streaming("abc</th", "abc</thx")
    assert delta is not None and delta.reasoning == "</thx"
    assert parser.extract_reasoning_content_streaming("abc</thx", "abc</thx</think>") is None
    delta = parser.extract_reasoning_content_streaming("abc</thx</think>", "abc</thx</think>ok")
    assert delta is not None and delta.content == "ok" and delta.reasoning is None


def test_registry_lists_names_and_rejects_unknown() -> None:
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    with pytest.raises(
        ValueError,
        match=r"reasoning_parser='granite' is not a reasoning parser; choose one of: "
        r"deepseek_r1, qwen3",
    ):
        get_reasoning_parser("granite")


def test_is_reasoning_end_on_token_ids() -> None:
    parser = make("deepseek_r1")
    assert (parser.start_token_id, parser.end_token_id) == (7, 8)
    assert not parser.is_reasoning_end([1, 2])
    assert not parser.is_reasoning_end([7, 1])
    assert parser.is_reasoning_end([7, 1, 8, 2])
    # An earlier turn's reasoning ended, but the prompt opens a new one.
    assert not parser.is_reasoning_end([7, 1, 8, 2, 7])
    assert parser.is_reasoning_end([8])
    # A vocabulary without the marker tokens: nothing can end the reasoning by id.
    blind = get_reasoning_parser("qwen3")({"a": 1})
    assert not blind.has_end_token and not blind.is_reasoning_end([1, 1])


def test_extract_content_ids() -> None:
    """The ids after the reasoning's end marker (vLLM's interface for plugin parsers)."""
    parser = make("deepseek_r1")
    assert parser.extract_content_ids([7, 1, 8, 2, 1]) == [2, 1]
    assert parser.extract_content_ids([1, 2, 8]) == []
    assert parser.extract_content_ids([7, 1, 2]) == []
    assert make("qwen3", {"enable_thinking": False}).extract_content_ids([1, 2]) == [1, 2]


# Qwen3's markers and a few text tokens, each id one piece of text (what `decode` joins).
QWEN_TEXT = {7: "<think>", 8: "</think>", 9: "<tool_call>", 10: "</tool_call>", 1: "a", 3: "\n"}
QWEN_TEXT |= {4: "<function=f>", 5: '{"name": "f"}', 6: " tags"}


def qwen3_on_ids(kwargs: dict | None = None, decode: bool = True) -> ReasoningParser:
    vocab = {text: token_id for token_id, text in QWEN_TEXT.items()}
    return get_reasoning_parser("qwen3")(vocab, kwargs, decode=qwen_decode if decode else None)


def qwen_decode(ids: Any) -> str:
    return "".join(QWEN_TEXT[i] for i in ids)


# Ids ending in an open call (XML or JSON, after whitespace or not) are past the reasoning; a mention
# of the tag, a call not yet shown to be one, a finished call (the tools' prompt shows one) are not.
QWEN_IDS = [
    ([1, 9, 3, 4], True),
    ([1, 9, 5], True),
    ([1, 9, 3, 4, 10], False),
    ([1, 9, 6, 8, 1], True),  # ended by </think>, after a mention
    ([1, 9, 6], False),
    ([1, 9], False),
    ([1, 9, 3], False),
    ([9, 3, 5, 3, 10, 1], False),
    ([9, 3, 5, 10, 7, 1], False),
    ([1, 9, 3, 4, 7, 1], False),  # a fresh <think> after it
]


@pytest.mark.parametrize(("ids", "ended"), QWEN_IDS)
def test_qwen3_tool_call_ends_the_reasoning_on_ids(ids: list[int], ended: bool) -> None:
    parser = qwen3_on_ids()
    assert parser.is_reasoning_end(ids) is ended
    # The content ids are the text split's content, wherever it starts (a call is content).
    assert qwen_decode(parser.extract_content_ids(ids)) == parser.split(qwen_decode(ids))[1]


def test_qwen3_tool_call_on_ids_needs_decode_and_thinking() -> None:
    # Without the tokenizer's decode a call cannot be told from a mention: only </think> ends it.
    blind = qwen3_on_ids(decode=False)
    assert not blind.is_reasoning_end([1, 9, 3, 4]) and blind.extract_content_ids([1, 9, 3, 4]) == []
    assert blind.is_reasoning_end([1, 9, 8])
    # The earlier of </think> and a call starts the content.
    assert qwen3_on_ids().extract_content_ids([1, 8, 1, 9, 5]) == [1, 9, 5]
    assert qwen3_on_ids().extract_content_ids([1, 9, 5, 8, 1]) == [9, 5, 8, 1]
    assert qwen3_on_ids({"enable_thinking": False}).extract_content_ids([1, 9, 5]) == [1, 9, 5]
