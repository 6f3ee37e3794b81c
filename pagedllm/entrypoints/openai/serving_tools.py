"""Tool calling for the chat endpoint: checking ``tools`` / ``tool_choice``, constraining the output for a
named or "required" tool choice, and reading each choice's output into content and tool calls.

- ``none`` (or no tools): plain content; the template still sees the tools, as in vLLM.
- named function: the output is the function's arguments, constrained by its ``parameters`` schema.
- ``required``: the output is a JSON array of one or more ``{"name", "parameters"}`` objects, one schema
  per tool (``anyOf``), each read as a call.
- ``auto``: the model decides; the server's --tool-call-parser reads its output.

The serving code hands each choice's content text (after any reasoning was split off) to a
`ChoiceToolCalls`, complete or delta by delta, and gets back the content and the tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionToolsParam,
    DeltaToolCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    ParsedText,
    ToolCallPrefix,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.json_calls import (
    is_valid_call_list,
    read_call_list,
    skip_ws,
    value_end,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

# A function without a parameters schema takes an empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCallingConfig:
    """The server's tool flags: --enable-auto-tool-choice and the parser --tool-call-parser names."""

    enable_auto_tool_choice: bool = False
    tool_parser: type[ToolParser] | None = None


def load_tool_calling_config(
    enable_auto_tool_choice: bool, tool_call_parser: str | None, tool_parser_plugin: str | None
) -> ToolCallingConfig:
    """The flags checked at start-up (ValueError naming the flag): the plugin file is loaded first, so
    that --tool-call-parser can name a parser it registers."""
    if tool_parser_plugin:
        ToolParserManager.import_tool_parser(tool_parser_plugin)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    parser = ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None
    return ToolCallingConfig(enable_auto_tool_choice, parser)


def effective_tool_choice(request: ChatCompletionRequest) -> str | ChatCompletionNamedToolChoiceParam:
    """tool_choice with OpenAI's defaults: "auto" when tools are given, else "none"; "required" with an
    empty tool list means "none"."""
    if not request.tools or request.tool_choice is None:
        return "auto" if request.tools else "none"
    return request.tool_choice


def check_tool_request(request: ChatCompletionRequest, config: ToolCallingConfig) -> None:
    """400 naming the field for a tool_choice the request or the server cannot honour."""
    choice = request.tool_choice
    if request.tools is None and choice not in (None, "none"):
        raise OpenAIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam) and _named_tool(request) is None:
        raise OpenAIError(
            f"The tool {choice.function.name!r} specified in `tool_choice` does not match any of the "
            "specified `tools`",
            param="tool_choice",
        )
    if effective_tool_choice(request) == "auto" and request.tools:
        if not (config.enable_auto_tool_choice and config.tool_parser is not None):
            raise OpenAIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
    forced = request.forces_tool_call()
    other = request.constraint_param() if forced else None
    if other is not None and other != "tools":
        raise OpenAIError(f"{other} cannot be combined with tool_choice {_choice_text(choice)}", param=other)


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _named_tool(request: ChatCompletionRequest) -> ChatCompletionToolsParam | None:
    choice = request.tool_choice
    assert isinstance(choice, ChatCompletionNamedToolChoiceParam)
    return next((t for t in request.tools or () if t.function.name == choice.function.name), None)


def tool_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced tool choice puts on the output (None for "none" and "auto")."""
    choice = effective_tool_choice(request)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        tool = _named_tool(request)
        assert tool is not None  # check_tool_request ran
        return tool.function.parameters or _NO_PARAMETERS
    if choice != "required":
        return None
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": t.function.parameters or _NO_PARAMETERS,
                    },
                    "required": ["name", "parameters"],
                }
                for t in request.tools or ()
            ],
        },
    }


def apply_tool_choice(
    request: ChatCompletionRequest, params: SamplingParams, config: ToolCallingConfig, tokenizer: Any
) -> None:
    """Set the tool schema as the output constraint of a forced tool choice; for "auto", keep special
    tokens when the parser's markers are special tokens of this tokenizer."""
    schema = tool_schema(request)
    if schema is not None:
        params.structured_outputs = StructuredOutputsParams(json=schema)
    elif effective_tool_choice(request) == "auto" and request.tools and config.tool_parser is not None:
        if config.tool_parser(tokenizer).keeps_special_tokens():
            params.skip_special_tokens = False


class NamedToolParser(ToolParser):
    """The output of a named tool choice: the arguments of that one function, as JSON."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedText:
        start = skip_ws(text, 0)
        end = value_end(text, start)
        return ParsedText(
            "", [ToolCallPrefix(self.name, text[start : end if end is not None else len(text)])]
        )


class RequiredToolParser(ToolParser):
    """The output of tool_choice "required": a JSON array of ``{"name", "parameters"}`` objects."""

    def parse(self, text: str, final: bool) -> ParsedText:
        start = skip_ws(text, 0)
        if start >= len(text) or text[start] != "[":
            return ParsedText(text if final else "")
        calls, end = read_call_list(text, start, ("parameters",))
        if final and (end is None or not is_valid_call_list(text[start:end], ("parameters",), len(calls))):
            return ParsedText(text)  # cut short (max_tokens): no calls to give
        return ParsedText("", calls)


class ChoiceToolCalls:
    """The reading of one choice's output into content and tool calls, complete or as a stream."""

    def __init__(self, parser: ToolParser, named: bool, parallel_tool_calls: bool) -> None:
        self.parser = parser
        self.named = named
        self.parallel_tool_calls = parallel_tool_calls
        self.text = ""

    def full(self, text: str) -> tuple[str | None, list[ToolCall]]:
        info = self.parser.extract_tool_calls(text)
        calls = info.tool_calls if self.parallel_tool_calls else info.tool_calls[:1]
        return info.content, calls

    def delta(self, delta_text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """The content and tool-call deltas to send for the next piece of output text."""
        self.text += delta_text
        content, deltas = self.parser.extract_tool_calls_streaming(self.text, finished)
        if not self.parallel_tool_calls:
            deltas = [d for d in deltas if d.index == 0]
        return content, deltas

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" when the output ended by calling tools; a named tool choice keeps
        "stop", as in vLLM, and an output cut short keeps "length"."""
        return "tool_calls" if called and reason == "stop" and not self.named else reason


def choice_tool_calls(
    request: ChatCompletionRequest, config: ToolCallingConfig, tokenizer: Any
) -> ChoiceToolCalls | None:
    """A fresh reader for one choice of the request, or None when its output is plain content."""
    choice = effective_tool_choice(request)
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return ChoiceToolCalls(NamedToolParser(choice.function.name), True, parallel)
    if choice == "required":
        return ChoiceToolCalls(RequiredToolParser(tokenizer), False, parallel)
    if choice == "auto" and request.tools and config.tool_parser is not None:
        return ChoiceToolCalls(config.tool_parser(tokenizer), False, parallel)
    return None
