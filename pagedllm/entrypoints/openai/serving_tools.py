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
from pagedllm.entrypoints.openai.tool_parsers.json_calls import call_list_so_far, skip_ws, value_end
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
    """tool_choice with OpenAI's defaults: "auto" when tools are given, else "none" (an empty tool list
    gives "none"; `check_tool_request` refuses it with "required")."""
    if not request.tools or request.tool_choice is None:
        return "auto" if request.tools else "none"
    return request.tool_choice


def check_tool_request(request: ChatCompletionRequest, config: ToolCallingConfig) -> None:
    """400 naming the field for a tool_choice the request or the server cannot honour."""
    choice = request.tool_choice
    if choice == "required" and not request.tools:
        # OpenAI refuses an empty tool list; with "required" it would ask for a call that cannot exist.
        raise OpenAIError('tool_choice "required" needs at least one tool in `tools`', param="tools")
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
    definitions: dict[str, Any] = {}
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _hoisted(
                            t.function.parameters or _NO_PARAMETERS,
                            f"#/items/anyOf/{i}/properties/parameters",
                            f"tool{i}",
                            definitions,
                        ),
                    },
                    "required": ["name", "parameters"],
                }
                for i, t in enumerate(request.tools or ())
            ],
        },
    }
    if request.parallel_tool_calls is False:
        # One call is all the answer keeps: the grammar stops the list there instead of letting the
        # model write calls that are dropped.
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


_DEFINITION_KEYS = ("$defs", "definitions")


def _pointer_token(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _hoisted(
    parameters: dict[str, Any], location: str, prefix: str, definitions: dict[str, Any]
) -> dict[str, Any]:
    """A tool's parameters schema moved to ``location`` inside the "required" schema. Its local ``$ref``s
    point at its own root (``#/$defs/Inner``, as every pydantic model with a nested model writes them),
    which is no longer the document's root: its definitions move into the root's ``definitions`` (as
    ``prefix.Name``) and every local reference is rewritten to where its target now is."""
    local = [
        (key, name, definition)
        for key in _DEFINITION_KEYS
        if isinstance(parameters.get(key), dict)
        for name, definition in parameters[key].items()
    ]
    moved = {
        f"#/{key}/{_pointer_token(name)}": f"#/$defs/{_pointer_token(f'{prefix}.{name}')}"
        for key, name, _ in local
    }

    def target(ref: str) -> str:
        if not ref.startswith("#"):
            return ref
        for old, new in moved.items():
            if ref == old or ref.startswith(old + "/"):
                return new + ref[len(old) :]
        return location + ref[1:]

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {
            key: target(value) if key == "$ref" and isinstance(value, str) else rewrite(value)
            for key, value in node.items()
        }

    for _, name, definition in local:
        definitions[f"{prefix}.{name}"] = rewrite(definition)
    return rewrite({key: value for key, value in parameters.items() if key not in _DEFINITION_KEYS})


def apply_tool_choice(
    request: ChatCompletionRequest, params: SamplingParams, config: ToolCallingConfig, tokenizer: Any
) -> None:
    """Set the tool schema as the output constraint of a forced tool choice; for "auto", keep special
    tokens when the parser's markers are special tokens of this tokenizer."""
    schema = tool_schema(request)
    if schema is not None:
        # No free whitespace: JSON's optional whitespace lets a small model wander in it (a stream that
        # sends nothing for minutes while the `[{"name": ` prefix waits for the name), as in vLLM.
        params.structured_outputs = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
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
        calls = call_list_so_far(text, skip_ws(text, 0), ("parameters",), final)
        # None: cut short (max_tokens), no calls to give.
        return ParsedText(text) if calls is None else ParsedText("", calls)


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
        parser = config.tool_parser(tokenizer)
        parser.tools = request.tools
        return ChoiceToolCalls(parser, False, parallel)
    return None
