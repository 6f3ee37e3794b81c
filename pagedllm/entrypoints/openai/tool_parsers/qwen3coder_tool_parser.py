"""Qwen3-Coder (and Qwen3.5) XML tool calls: content, then calls written as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A parameter's value is text, not JSON: it becomes a JSON value by the type its tool's schema gives it (a
string stays a string; numbers, booleans, objects and arrays are read as JSON; ``null`` is null), as
vLLM's parser does. A stream sends each parameter once its value is closed, and the closing brace once
the function is; text after the calls is dropped, as the model should stop there.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedText,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import ToolCallPrefix, content_before_markers

TOOL_CALL = "<tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows; a string without a schema or a type (as vLLM)."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list) and declared:
        return [str(t) for t in declared]
    return ["string"]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: json.dumps would write invalid JSON


def typed_value(raw: str, schema: Any) -> Any:
    """The JSON value of a parameter written as text, by its schema."""
    types = _schema_types(schema)
    if raw.strip().lower() == "null" and types != ["string"]:
        return None
    if "string" in types:
        return raw
    if "boolean" in types and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, ValueError):
        pass
    if "object" in types or "array" in types:
        try:
            # Python literals ({'a': 1}, True) that some outputs carry; literal_eval runs no code.
            return ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return raw


def _value_text(value: str) -> str:
    # The template writes each value on lines of its own.
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


@ToolParserManager.register_module(["qwen3_coder", "qwen3_xml"])
class Qwen3CoderToolParser(ToolParser):
    markers = (TOOL_CALL, "</tool_call>")

    def parse(self, text: str, final: bool) -> ParsedText:
        content, pos = content_before_markers(text, (TOOL_CALL, FUNCTION), final)
        parsed = ParsedText(content)
        while pos >= 0:
            start = text.find(FUNCTION, pos)
            if start < 0:
                break
            name_end = text.find(">", start)
            if name_end < 0:
                return ParsedText(text) if final and not parsed.tool_calls else parsed
            name = text[start + len(FUNCTION) : name_end].strip()
            end = text.find(FUNCTION_END, name_end)
            closed = end >= 0
            body = text[name_end + 1 : end if closed else len(text)]
            parsed.tool_calls.append(ToolCallPrefix(name, self._arguments(name, body, closed or final)))
            pos = end + len(FUNCTION_END) if closed else -1
        return parsed

    def _parameter_schemas(self, function_name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool.function.name == function_name and isinstance(tool.function.parameters, dict):
                properties = tool.function.parameters.get("properties")
                return properties if isinstance(properties, dict) else {}
        return {}

    def _arguments(self, function_name: str, body: str, complete: bool) -> str:
        """The JSON text of the parameters in a function's body so far: each parameter once its value is
        closed (by its end tag, the next parameter, or the end of a complete body), and the closing
        brace once the body is complete."""
        schemas = self._parameter_schemas(function_name)
        pairs: list[str] = []
        pos = body.find(PARAMETER)
        while pos >= 0:
            name_end = body.find(">", pos)
            if name_end < 0:
                break
            name = body[pos + len(PARAMETER) : name_end].strip()
            ends = [i for i in (body.find(PARAMETER_END, name_end), body.find(PARAMETER, name_end)) if i >= 0]
            if not ends and not complete:
                break
            value_end = min(ends) if ends else len(body)
            value = typed_value(_value_text(body[name_end + 1 : value_end]), schemas.get(name))
            pairs.append(f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            pos = body.find(PARAMETER, value_end)
        return "{" + ", ".join(pairs) + ("}" if complete else "")
