"""Reading tool calls written as JSON, from text that may still be growing (a stream).

A call is an object with a ``name`` and its arguments under one of a few keys. The arguments are kept as
the model wrote them (the raw JSON text of the value), so that every partial reading of a growing text
yields a prefix of the final arguments string: streamed fragments then join into exactly the complete
result. The scanners never raise on malformed text; they stop where they cannot go on, and callers check
a complete call with `json.loads` (`is_valid_call`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\n\r"
_CLOSERS = {"{": "}", "[": "]"}


@dataclass
class ToolCallPrefix:
    """A tool call as far as the text shows it: its name, and a prefix of its arguments' JSON text."""

    name: str
    arguments: str


@dataclass
class ParsedText:
    """One reading of an output text: its content, and its tool calls (complete when the text is)."""

    content: str
    tool_calls: list[ToolCallPrefix] = field(default_factory=list)


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _string_end(text: str, pos: int) -> int | None:
    """The index after the JSON string starting at ``text[pos] == '"'``; None if it is not closed yet."""
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == '"':
            return pos + 1
        pos += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value starting at ``pos`` (no leading whitespace); None while it is not
    complete. A number or literal at the very end of the text is incomplete: more digits may follow."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return _string_end(text, pos)
    if first in _CLOSERS:
        stack = [_CLOSERS[first]]
        pos += 1
        while pos < len(text):
            char = text[pos]
            if char == '"':
                end = _string_end(text, pos)
                if end is None:
                    return None
                pos = end
                continue
            if char in _CLOSERS:
                stack.append(_CLOSERS[char])
            elif char in "}]":
                if char != stack.pop():
                    return pos + 1  # mismatched: the caller's json.loads refuses it
                if not stack:
                    return pos + 1
            pos += 1
        return None
    while pos < len(text) and text[pos] not in _WHITESPACE + ",}]:;":
        pos += 1
    return None if pos >= len(text) else pos


def read_call(
    text: str, pos: int, argument_keys: tuple[str, ...]
) -> tuple[ToolCallPrefix | None, int | None]:
    """The call in the JSON object starting at ``text[pos] == '{'``, and the index after the object (None
    while it is open). The call is None until its name is complete; its arguments are the raw text of the
    first of ``argument_keys`` present ("{}" for a closed object without any)."""
    name: str | None = None
    arguments = ""
    end: int | None = None
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "}":
            end = pos + 1
            break
        key_end = _string_end(text, pos) if text[pos] == '"' else None
        if key_end is None:
            break
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            break
        value_start = skip_ws(text, pos + 1)
        value_stop = value_end(text, value_start)
        if key == "name" and value_stop is not None and text[value_start] == '"':
            name = json.loads(text[value_start:value_stop])
        elif key in argument_keys and not arguments:
            arguments = text[value_start : value_stop if value_stop is not None else len(text)]
        if value_stop is None:
            break
        pos = skip_ws(text, value_stop)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    if name is None:
        return None, end
    if end is not None and not arguments:
        arguments = "{}"
    return ToolCallPrefix(name, arguments), end


def read_call_list(
    text: str, pos: int, argument_keys: tuple[str, ...]
) -> tuple[list[ToolCallPrefix], int | None]:
    """The calls in the JSON array of objects starting at ``text[pos] == '['``, and the index after the
    array (None while it is open or not an array of objects)."""
    calls: list[ToolCallPrefix] = []
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "]":
            return calls, pos + 1
        if text[pos] != "{":
            break
        call, end = read_call(text, pos, argument_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            break
        pos = skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
    return calls, None


def _is_call(call: object, argument_keys: tuple[str, ...]) -> bool:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return False
    return isinstance(next((call[key] for key in argument_keys if key in call), {}), dict)


def is_valid_call(raw: str, argument_keys: tuple[str, ...]) -> bool:
    """Whether the JSON text of one call object parses, with a string name and object arguments."""
    try:
        return _is_call(json.loads(raw), argument_keys)
    except json.JSONDecodeError:
        return False


def is_valid_call_list(raw: str, argument_keys: tuple[str, ...], count: int) -> bool:
    """Whether the JSON text of a list parses into ``count`` valid calls (`is_valid_call`)."""
    try:
        calls = json.loads(raw)
    except json.JSONDecodeError:
        return False
    return isinstance(calls, list) and len(calls) == count and all(_is_call(c, argument_keys) for c in calls)


def is_json_object(raw: str) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except json.JSONDecodeError:
        return False


def call_list_so_far(
    text: str, pos: int, argument_keys: tuple[str, ...], final: bool
) -> list[ToolCallPrefix] | None:
    """The calls of the JSON list of call objects at ``pos`` (those the text shows so far, while it may
    grow); None when the text there is not such a list (a final text: one that does not parse)."""
    if pos >= len(text) or text[pos] != "[":
        return None if final or pos < len(text) else []
    calls, end = read_call_list(text, pos, argument_keys)
    if final and (end is None or not is_valid_call_list(text[pos:end], argument_keys, len(calls))):
        return None
    return calls


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``: a stream keeps them
    until it knows whether the marker follows."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def content_before_markers(text: str, markers: tuple[str, ...], final: bool) -> tuple[str, int]:
    """The content before the earliest of ``markers`` in ``text`` and that marker's index (-1 when none
    is there yet: then, while the text may grow, a tail that could start a marker is held back)."""
    found = [index for index in (text.find(m) for m in markers) if index >= 0]
    if found:
        return text[: min(found)], min(found)
    if final:
        return text, -1
    return text[: len(text) - max(held_back(text, m) for m in markers)], -1
