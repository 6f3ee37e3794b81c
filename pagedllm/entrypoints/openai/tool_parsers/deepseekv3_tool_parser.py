"""DeepSeek-V3 tool calls: content, then the calls between DeepSeek's special tokens,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and DeepSeek-V3.1's shorter form, ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
<｜tool▁call▁end｜>``; text after the calls is dropped, as the model should stop there."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    ParsedText,
    ToolCallPrefix,
    content_before_markers,
    is_json_object,
    skip_ws,
    value_end,
)

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
JSON_FENCE = "```json\n"


@ToolParserManager.register_module(["deepseek_v3", "deepseek_v31"])
class DeepSeekV3ToolParser(ToolParser):
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def parse(self, text: str, final: bool) -> ParsedText:
        content, pos = content_before_markers(text, (CALLS_BEGIN, CALL_BEGIN), final)
        parsed = ParsedText(content)
        while pos >= 0:
            begin = text.find(CALL_BEGIN, pos)
            if begin < 0:
                break
            read = self._read_call(text, begin + len(CALL_BEGIN))
            if read is None:  # malformed
                return ParsedText(text) if final else parsed
            call, end = read
            if call is not None:
                parsed.tool_calls.append(call)
            if end is None:
                if final:  # cut short
                    return ParsedText(text)
                break
            pos = end
        return parsed

    @staticmethod
    def _read_call(text: str, pos: int) -> tuple[ToolCallPrefix | None, int | None] | None:
        """The call whose begin token ends at ``pos`` (None until its name is known) and the index after
        its arguments (None while they are open); None when the text there is not a call."""
        sep = text.find(SEP, pos)
        if sep < 0:
            return None, None
        kind = text[pos:sep].strip()
        arguments_start = sep + len(SEP)
        if kind == "function":  # V3: the name on the separator's line, the arguments in a JSON fence
            newline = text.find("\n", arguments_start)
            if newline < 0:
                return None, None
            name = text[arguments_start:newline].strip()
            arguments_start = newline + 1
            fence = text[arguments_start : arguments_start + len(JSON_FENCE)]
            if not JSON_FENCE.startswith(fence):
                return None
            if len(fence) < len(JSON_FENCE):
                return ToolCallPrefix(name, ""), None
            arguments_start += len(JSON_FENCE)
        else:  # V3.1: the name before the separator, the arguments right after it
            name = kind
        arguments_start = skip_ws(text, arguments_start)
        if arguments_start < len(text) and text[arguments_start] != "{":
            return None
        end = value_end(text, arguments_start)
        arguments = text[arguments_start : len(text) if end is None else end]
        if end is not None and not is_json_object(arguments):
            return None
        return ToolCallPrefix(name, arguments), end
