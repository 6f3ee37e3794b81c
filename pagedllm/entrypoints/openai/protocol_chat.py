"""Request and response models of the chat endpoint (/v1/chat/completions), in OpenAI's shape with
vLLM's extras: messages, tools and tool calls, reasoning fields, logprobs, stream chunks; and the
/tokenize request made of chat messages."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    PromptLogprobsField,
    SamplingFields,
    UsageInfo,
    make_tool_call_id,
)
from pagedllm.sampling_params import SamplingParams


class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    # The arguments as a JSON string (OpenAI's shape); chat templates get them as a dict.
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to one of those calls.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema of the arguments.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # None means "auto" when tools are given, else "none" (as OpenAI and vLLM).
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template writes the special tokens itself.
    add_special_tokens: bool = False
    # False drops the reasoning of a --reasoning-parser model from the response (the content stays).
    include_reasoning: bool = True
    # vLLM's: the answer starts with the last message's content when it continues that message's role.
    echo: bool = False

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        # vLLM's check and message; "none" needs no tools. `tools` is declared first, so it is in
        # info.data when it validated (when it did not, its own error comes first).
        if choice not in (None, "none") and "tools" in info.data and info.data["tools"] is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        return choice

    def forces_tool_call(self) -> bool:
        """Named and "required" tool choices: the output is constrained to tool calls by a JSON schema."""
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam)
        )

    def constraint_param(self) -> str | None:
        # The tool schemas constrain the output when the tool choice forces a call.
        return super().constraint_param() or ("tools" if self.forces_tool_call() else None)

    def to_sampling_params(self) -> SamplingParams:
        # Neither limit given: None lets the output run up to the end of the context, as in vLLM.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ReasoningFields(OpenAIBaseModel):
    """The reasoning of a --reasoning-parser model. vLLM names it `reasoning` and keeps the older
    `reasoning_content` as an alias: both carry the same text, whichever one is set."""

    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _sync_reasoning(self) -> ReasoningFields:
        if self.reasoning is None:
            self.reasoning = self.reasoning_content
        elif self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        return self


class ChatResponseMessage(ReasoningFields):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    # vLLM's: the prompt's logprobs when the request asks for prompt_logprobs.
    prompt_logprobs: PromptLogprobsField | None = None


class OmitsNoneFields(OpenAIBaseModel):
    """A streamed delta: OpenAI leaves out the fields a chunk does not carry instead of sending them as
    null (clients join deltas with `arguments += fragment`, which a null breaks)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OmitsNoneFields):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitsNoneFields):
    """One piece of a streamed tool call, at most one per call index in a chunk: the first carries id,
    type, name and the arguments so far (a string, "" when none yet), the next ones fragments of the
    arguments, all tied together by index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ReasoningFields, OmitsNoneFields):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
