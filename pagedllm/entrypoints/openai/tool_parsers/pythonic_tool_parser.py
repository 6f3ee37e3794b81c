"""Pythonic tool calls (Llama 3.2 / Llama 4 style, ToolACE): the output is a Python list of calls with
keyword arguments, ``[get_weather(city="Paris", days=2), get_time()]``, read with `ast`. The arguments
become a JSON object; a stream sends each call's name when it is known and its arguments when the call
is complete (a Python literal cannot be turned into JSON piece by piece)."""

from __future__ import annotations

import ast
import json
import re

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ToolCallPrefix, skip_ws

_NAME = re.compile(r"[A-Za-z_][\w.]*")
_OPEN = "([{"
_CLOSE = ")]}"


def _python_string_end(text: str, pos: int) -> int | None:
    """The index after the Python string literal starting at ``pos`` (None if not closed yet)."""
    quote = text[pos] * 3 if text.startswith(text[pos] * 3, pos) else text[pos]
    pos += len(quote)
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
        elif text.startswith(quote, pos):
            return pos + len(quote)
        else:
            pos += 1
    return None


def _call_end(text: str, pos: int) -> int | None:
    """The index after the parenthesised argument list opening at ``text[pos] == '('``."""
    depth = 0
    while pos < len(text):
        char = text[pos]
        if char in "'\"":
            end = _python_string_end(text, pos)
            if end is None:
                return None
            pos = end
            continue
        if char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None


def _arguments(call_text: str) -> str | None:
    """The keyword arguments of one call as a JSON object text (None if it is not such a call)."""
    try:
        call = ast.parse(call_text, mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
        if len(arguments) != len(call.keywords):
            return None  # **kwargs
        return json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError):
        return None


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedText:
        pos = skip_ws(text, 0)
        if pos >= len(text):
            return ParsedText(text if final else "")
        if text[pos] != "[":
            return ParsedText(text)
        calls: list[ToolCallPrefix] = []
        pos = skip_ws(text, pos + 1)
        while pos < len(text) and text[pos] != "]":
            name = _NAME.match(text, pos)
            paren = skip_ws(text, name.end()) if name else pos
            if name is None or paren >= len(text) or text[paren] != "(":
                # An unfinished name waits; anything else is not a call list.
                return ParsedText(text) if final or paren < len(text) else ParsedText("", calls)
            end = _call_end(text, paren)
            arguments = None if end is None else _arguments(text[pos:end])
            if arguments is None:
                if final or end is not None:
                    return ParsedText(text)
                calls.append(ToolCallPrefix(name.group(), ""))
                return ParsedText("", calls)
            calls.append(ToolCallPrefix(name.group(), arguments))
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_ws(text, pos + 1)
        if final and (pos >= len(text) or text[pos + 1 :].strip()):
            return ParsedText(text)
        return ParsedText("", calls)
