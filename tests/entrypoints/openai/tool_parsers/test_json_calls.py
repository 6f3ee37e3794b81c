"""The JSON call scanners: partial texts give prefixes of the final arguments, complete ones their ends."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ToolCallPrefix,
    held_back,
    is_valid_call,
    is_valid_call_list,
    read_call,
    read_call_list,
    value_end,
)

KEYS = ("arguments",)


@pytest.mark.parametrize(
    ("text", "end"),
    [
        ('"a\\"}b" tail', 7),
        ('{"a": [1, "]}"], "b": {}} x', 25),
        ("[1, [2, 3]]", 11),
        ("12,", 2),
        ("12", None),  # more digits may follow
        ('{"a": "unclosed', None),
        ('{"a": [1, 2]', None),
    ],
)
def test_value_end(text: str, end: int | None) -> None:
    assert value_end(text, 0) == end


def test_read_call_grows_into_the_final_arguments() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
    final, end = read_call(text, 0, KEYS)
    assert end == len(text) and final == ToolCallPrefix("get_weather", '{"city": "Paris", "days": [1, 2]}')
    for size in range(len(text)):
        call, call_end = read_call(text[:size], 0, KEYS)
        assert call_end is None
        # No name before it is complete; then arguments always a prefix of the final ones.
        assert call is None or (call.name == "get_weather" and final.arguments.startswith(call.arguments))


def test_read_call_arguments_before_name_and_missing_arguments() -> None:
    call, _ = read_call('{"arguments": {"x": 1}, "name": "f"}', 0, KEYS)
    assert call == ToolCallPrefix("f", '{"x": 1}')
    call, end = read_call('{"name": "f"}', 0, KEYS)
    assert call == ToolCallPrefix("f", "{}") and end == 13


def test_read_call_list_and_validity() -> None:
    text = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    calls, end = read_call_list(text, 0, KEYS)
    assert [c.name for c in calls] == ["a", "b"] and end == len(text)
    assert is_valid_call_list(text, KEYS, 2)
    assert not is_valid_call_list(text, KEYS, 3)
    assert read_call_list(text[:-1], 0, KEYS)[1] is None
    assert is_valid_call('{"name": "a", "arguments": {}}', KEYS)
    assert not is_valid_call('{"name": "a", "arguments": [1]}', KEYS)
    assert not is_valid_call('{"name": 3}', KEYS)
    assert not is_valid_call('{"name": "a"', KEYS)


def test_held_back() -> None:
    assert held_back("Hello <tool", "<tool_call>") == 5
    assert held_back("Hello <", "<tool_call>") == 1
    assert held_back("Hello", "<tool_call>") == 0
