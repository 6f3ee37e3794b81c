"""Mistral tool calls: content, then ``[TOOL_CALLS]`` and the calls, in one of the shapes Mistral's models
write: a JSON list of ``{"name": ..., "arguments": {...}}`` objects, a single such object, or (tokenizer v11
and later) ``name{...}`` / ``name[ARGS]{...}``. Each ``[TOOL_CALLS]`` marker opens a group of calls, and
every group is read (a later marker never hides an earlier call). Text between a marker and its calls is
dropped; text after a group's calls is content.

Tool call ids are 9 letters and digits: Mistral's chat templates refuse any other id when the assistant
turn is sent back, so a multi-turn tool loop needs them.
"""

from __future__ import annotations

import random
import re
import string

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ToolCallPrefix,
    held_back,
    is_json_object,
    is_valid_call,
    is_valid_call_list,
    read_call,
    read_call_list,
    skip_ws,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARGUMENT_KEYS = ("arguments", "parameters")
_ID_ALPHABET = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Where the calls of a group may start after junk: a list of objects, or an object with a name.
_CALLS_START = re.compile(r'\[\s*\{|\{\s*"name"')


def _group_end(text: str, pos: int) -> int:
    """Where the group opened before ``pos`` ends: at the next marker, or the end of the text."""
    end = text.find(BOT, pos)
    return len(text) if end < 0 else end


# A reading of the calls at some position: (calls, end or None while open, valid when closed).
_Read = tuple[list[ToolCallPrefix], int | None, bool]


def _read_json_calls(text: str, pos: int) -> _Read:
    """The calls of the JSON list or object at ``pos``."""
    if text[pos] == "[":
        calls, end = read_call_list(text, pos, ARGUMENT_KEYS)
        return calls, end, end is not None and is_valid_call_list(text[pos:end], ARGUMENT_KEYS, len(calls))
    call, end = read_call(text, pos, ARGUMENT_KEYS)
    return (
        ([] if call is None else [call]),
        end,
        end is not None and is_valid_call(text[pos:end], ARGUMENT_KEYS),
    )


def _read_named_calls(text: str, pos: int, complete: bool) -> _Read | None:
    """``name{...}`` or ``name[ARGS]{...}`` calls at ``pos`` (several, separated by commas or spaces);
    None when the text there is not that shape. ``complete``: the text will not grow."""
    calls: list[ToolCallPrefix] = []
    while True:
        name = _NAME.match(text, pos)
        if name is None:
            return (calls, pos, True) if calls else None
        after = name.end()
        if text.startswith(ARGS, after):
            after += len(ARGS)
        elif not complete and ARGS.startswith(text[after:]):
            return calls, None, False  # the name, or "[AR", may still grow
        if after >= len(text) or text[after] != "{":
            return (calls, pos, True) if calls else None
        end = value_end(text, after)
        calls.append(ToolCallPrefix(name.group(), text[after : end if end is not None else len(text)]))
        if end is None:
            return calls, None, False
        if not is_json_object(text[after:end]):
            return calls, end, False
        pos = skip_ws(text, end)
        if text.startswith(",", pos):
            pos = skip_ws(text, pos + 1)
        if pos >= len(text):
            return (calls, end, True) if complete else (calls, None, False)


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    markers = (BOT, ARGS)

    def make_call_id(self) -> str:
        return "".join(random.choices(_ID_ALPHABET, k=9))

    def parse(self, text: str, final: bool) -> ParsedText:
        start = text.find(BOT)
        if start < 0:
            return ParsedText(text if final else text[: len(text) - held_back(text, BOT)])
        parsed = ParsedText(text[:start])
        while start >= 0:
            group = self._read_group(text, start + len(BOT), final)
            if group is None:  # no calls in this group: the output is not what it claims
                return ParsedText(text.replace(BOT, "")) if final else parsed
            calls, trail_start = group
            parsed.tool_calls += calls
            if trail_start is None:
                return parsed
            start = text.find(BOT, trail_start)
            trail = text[trail_start : len(text) if start < 0 else start]
            if start < 0 and not final:
                trail = trail[: len(trail) - held_back(trail, BOT)]
            parsed.content += trail
        return parsed

    def _read_group(self, text: str, pos: int, final: bool) -> tuple[list[ToolCallPrefix], int | None] | None:
        """The calls of the group whose marker ends at ``pos``, and where its trailing text starts (None
        while the calls are open); None when the group holds no calls."""
        group_end = _group_end(text, pos)
        complete = final or group_end < len(text)
        segment = text[:group_end]
        pos = skip_ws(segment, pos)
        read: _Read | None = None
        if pos < len(segment):
            if segment[pos] in "[{":
                read = _read_json_calls(segment, pos)
            else:
                read = _read_named_calls(segment, pos, complete)
            if read is None:
                # Junk before the calls (dropped, as the model meant the calls): look for them further on.
                found = _CALLS_START.search(segment, pos)
                read = None if found is None else _read_json_calls(segment, found.start())
        if read is None:
            return None if complete else ([], None)
        calls, end, valid = read
        if end is None:
            return None if complete else (calls, None)
        return (calls, end) if valid else None
