"""OpenAI's harmony format (gpt-oss), documented in openai/harmony: the output is a sequence of messages,
each a header and a body. The first message's `<|start|>assistant` is in the prompt:

    <|channel|>analysis<|message|>We need the weather tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

or, once the tools answered, `<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The
recipient may also follow the role (`<|start|>assistant to=functions.get_weather<|channel|>commentary
json<|message|>`). Read as vLLM's `openai` parser reads it: a message to `functions.NAME` is a call of
NAME with its body as the JSON arguments, the `final` channel is the content, and the analysis channel
(the reasoning) and other messages are neither. The stop tokens `<|call|>` and `<|return|>` may be cut
from the text: its end then ends the last message. Output that does not start with a header is plain
content."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ParsedText,
    ToolCallPrefix,
    content_before_markers,
)

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>")
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")


@ToolParserManager.register_module("openai")
class OpenAIToolParser(ToolParser):
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, *MESSAGE_ENDS)

    def parse(self, text: str, final: bool) -> ParsedText:
        if not text.startswith((START, CHANNEL)):
            if not final and (START.startswith(text) or CHANNEL.startswith(text)):
                return ParsedText("")  # a header may be opening
            return ParsedText(text)
        content: list[str] = []
        calls: list[ToolCallPrefix] = []
        pos = 0
        while pos < len(text):
            if pos > 0 and not text.startswith(START, pos):
                if final:
                    return ParsedText(text)  # not a message after a message
                break  # `<|sta` so far, or text that the final reading refuses
            header_end = text.find(MESSAGE, pos)
            if header_end < 0:
                if final:
                    return ParsedText(text)  # a header without a body
                break
            header = text[pos:header_end]
            body_start = header_end + len(MESSAGE)
            body, end = content_before_markers(text[body_start:], MESSAGE_ENDS, final)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL.search(header)
            if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
                calls.append(ToolCallPrefix(recipient.group(1)[len(FUNCTIONS) :], body))
            elif channel is not None and channel.group(1) == "final":
                content.append(body)
            if end < 0:
                break  # the body runs to the end of the text (so far)
            ends_with = next(m for m in MESSAGE_ENDS if text.startswith(m, body_start + end))
            pos = body_start + end + len(ends_with)
        if final and not all(_is_json(call.arguments) for call in calls):
            return ParsedText(text)
        return ParsedText("".join(content), calls)


def _is_json(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True
