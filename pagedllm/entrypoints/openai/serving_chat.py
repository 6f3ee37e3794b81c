"""POST /v1/chat/completions: render the conversation with the chat template, generate, answer as OpenAI."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import TokensPrompt
from pagedllm.entrypoints.openai.chat_rendering import ChatPromptRenderer
from pagedllm.entrypoints.openai.cli_args import FrontendOptions
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import UsageInfo
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from pagedllm.entrypoints.openai.request_limits import RequestLimits
from pagedllm.entrypoints.openai.serving_beam_search import (
    BeamSearchStream,
    beam_search_params,
    check_beam_search_request,
    start_beam_searches,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_reasoning import ReasoningSplitter
from pagedllm.entrypoints.openai.serving_tools import (
    ChoiceToolCalls,
    ToolCallingConfig,
    apply_tool_choice,
    check_tool_request,
    choice_tool_calls,
)
from pagedllm.entrypoints.openai.serving_utils import (
    SSE_DONE,
    PromptTokenizer,
    check_prompt_logprobs,
    check_stream_options,
    check_supported_fields,
    engine_dead_error,
    includes_usage,
    logprob_formatter,
    merge_streams,
    request_error,
    response_id,
    sse,
    sse_error,
    start_requests,
    truncate_prompt,
    usage_info,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput

logger = logging.getLogger("pagedllm.entrypoints.openai")

PROMPT_PARAM = "messages"


def _chat_error(request: ChatCompletionRequest, error: OpenAIError) -> OpenAIError:
    """Name the field the client set: the engine knows one output limit (max_tokens) and one logprobs
    count (logprobs), which chat requests give as max_completion_tokens and top_logprobs."""
    renames = {"logprobs": "top_logprobs"}
    if request.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    if error.param == "tools":  # the tool choice's schema, which the engine knows as a constraint
        error.message = error.message.replace("structured_outputs.json", "tools[].function.parameters")
    new_name = renames.get(error.param or "")
    if new_name is not None:
        error.message = re.sub(rf"\b{error.param}\b", new_name, error.message)
        error.param = new_name
    return error


def _stream_tool_calls(tools: ChoiceToolCalls | None, choice: ChatCompletionStreamChoice) -> bool:
    """Turn the chunk's content into content and tool-call deltas; False when it has nothing left to send
    (text held back until the reader knows whether it starts a tool call)."""
    if tools is None:
        return True
    content, deltas = tools.delta(choice.delta.content or "", choice.finish_reason is not None)
    choice.delta.content = content
    choice.delta.tool_calls = deltas or None
    choice.finish_reason = tools.finish_reason(choice.finish_reason, tools.parser.streamed_tool_calls)
    return bool(
        content or deltas or choice.delta.reasoning_content or choice.finish_reason or choice.logprobs
    )


class OpenAIServingChat:
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        prompts: PromptTokenizer,
        chat_renderer: ChatPromptRenderer,
        limits: RequestLimits,
        tool_calling: ToolCallingConfig | None = None,
        options: FrontendOptions | None = None,
    ) -> None:
        self.engine = engine
        self.options = options or FrontendOptions()
        self.tool_calling = tool_calling or ToolCallingConfig()
        self.models = models
        self.prompts = prompts
        self.chat_renderer = chat_renderer
        self.limits = limits
        self.reasoning = ReasoningSplitter(engine.engine_config, engine.tokenizer)

    def _check_supported(self, request: ChatCompletionRequest) -> None:
        check_supported_fields(request, self.limits)
        self.limits.check_count("messages", request.messages)
        self.limits.check_tools(request.tools)
        check_tool_request(request, self.tool_calling)
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs to be true", param="top_logprobs")
        check_stream_options(request)
        check_prompt_logprobs(request)
        check_beam_search_request(request)
        if request.ignored_fields():
            logger.warning("Ignoring unknown chat completion fields: %s", ", ".join(request.ignored_fields()))

    async def create(
        self, request: ChatCompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        model = self.models.check_model(request.model)
        self._check_supported(request)
        try:
            params = request.to_sampling_params()
        except ValueError as e:
            raise _chat_error(request, request_error(e, PROMPT_PARAM, request.constraint_param())) from e
        apply_tool_choice(request, params, self.tool_calling, self.engine.tokenizer)
        text = await self.chat_renderer.render(
            request.messages,
            request.chat_template,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
            [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None,
        )
        token_ids = await self.prompts.encode(text, request.add_special_tokens, PROMPT_PARAM)
        kept = truncate_prompt(token_ids, request, self.engine.max_model_len)
        request_id, engine_id = response_id("chatcmpl", request)
        prompt: TokensPrompt = {"prompt_token_ids": kept}
        if len(kept) == len(token_ids):
            prompt["prompt"] = text
        lora = self.models.lora_request(model)
        try:
            if request.use_beam_search:
                streams: list[RequestStream] | list[BeamSearchStream] = self._beam_searches(
                    request, engine_id, prompt, lora
                )
            else:
                streams = await start_requests(
                    self.engine,
                    engine_id,
                    [prompt],
                    params,
                    request.priority,
                    PROMPT_PARAM,
                    request.constraint_param(),
                    trace_headers=trace_headers,
                    lora_request=lora,
                )
        except OpenAIError as e:
            raise _chat_error(request, e) from e
        if request.stream:
            return self._stream(request, request_id, model, streams[0])
        return await self._full(request, request_id, model, streams[0])

    def _beam_searches(
        self, request: ChatCompletionRequest, engine_id: str, prompt: TokensPrompt, lora: LoRARequest | None
    ) -> list[BeamSearchStream]:
        limit = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        room = self.engine.max_model_len - len(prompt["prompt_token_ids"])
        params = beam_search_params(
            request, room if limit is None else limit, self.engine.input_processor.max_logprobs
        )
        try:
            return start_beam_searches(self.engine, engine_id, [prompt], params, lora)
        except ValueError as e:
            raise request_error(e, PROMPT_PARAM) from e

    def _logprobs(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatCompletionLogProbs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        formatter = logprob_formatter(self.engine.tokenizer, self.options, request)
        return formatter.chat_content(completion.token_ids, completion.logprobs, request.top_logprobs or 0)

    def _role(self, request: ChatCompletionRequest) -> str:
        """The answer's role: --response-role after a generation prompt, else the role of the message
        the model continues (as vLLM)."""
        return self.options.response_role if request.add_generation_prompt else request.messages[-1].role

    def _echo(self, request: ChatCompletionRequest) -> str:
        """Chat echo: the last message's content, when the answer continues it (same role)."""
        last = request.messages[-1]
        if not request.echo or last.role != self._role(request):
            return ""
        if isinstance(last.content, list):
            return "\n".join(part.text or "" for part in last.content)
        return last.content or ""

    def _read_tool_calls(self, request: ChatCompletionRequest, choice: ChatCompletionResponseChoice) -> None:
        """Split the choice's content into content and tool calls, when the request asks for tools."""
        tools = choice_tool_calls(request, self.tool_calling, self.engine.tokenizer)
        if tools is None:
            return
        choice.message.content, choice.message.tool_calls = tools.full(choice.message.content or "")
        choice.finish_reason = tools.finish_reason(choice.finish_reason, bool(choice.message.tool_calls))

    async def _full(
        self, request: ChatCompletionRequest, request_id: str, model: str, stream: RequestStream
    ) -> ChatCompletionResponse:
        final = None
        try:
            async for _, output in merge_streams([stream]):
                final = output
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        except ValueError as e:  # rejected by the core at admission
            raise _chat_error(request, request_error(e, PROMPT_PARAM, request.constraint_param())) from e
        assert final is not None and final.finished
        reasoning = self.reasoning.for_request(request)
        echo = self._echo(request)
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=reasoning.message(c.text),
                logprobs=self._logprobs(request, c),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in final.outputs
        ]
        for choice in choices:
            self._read_tool_calls(request, choice)
            choice.message.role = self._role(request)
            if echo:
                choice.message.content = echo + (choice.message.content or "")
        prompt_tokens = len(final.prompt_token_ids or [])
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = usage_info(self.options, prompt_tokens, completion_tokens, final.num_cached_tokens)
        response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
        if request.prompt_logprobs is not None and final.prompt_logprobs is not None:
            formatter = logprob_formatter(self.engine.tokenizer, self.options, request)
            response.prompt_logprobs = formatter.prompt_logprobs(final.prompt_logprobs)
        return response

    def _opening_chunks(
        self, request: ChatCompletionRequest, request_id: str, model: str
    ) -> list[ChatCompletionStreamResponse]:
        """OpenAI's first chunk of each choice, carrying the role; then chat echo's content, if any."""
        deltas = [DeltaMessage(role=self._role(request), content="")]
        if echo := self._echo(request):
            deltas.append(DeltaMessage(content=echo))
        return [
            ChatCompletionStreamResponse(
                id=request_id, model=model, choices=[ChatCompletionStreamChoice(index=index, delta=delta)]
            )
            for delta in deltas
            for index in range(request.n)
        ]

    async def _stream(
        self, request: ChatCompletionRequest, request_id: str, model: str, stream: RequestStream
    ) -> AsyncIterator[str]:
        include_usage, continuous = includes_usage(self.options, request)
        prompt_tokens = 0
        completion_tokens = 0
        cached_tokens = 0
        tool_readers = [
            choice_tool_calls(request, self.tool_calling, self.engine.tokenizer) for _ in range(request.n)
        ]
        reasoning = self.reasoning.for_request(request)

        def usage() -> UsageInfo:
            return usage_info(self.options, prompt_tokens, completion_tokens, cached_tokens)

        opened = False
        try:
            async for _, output in merge_streams([stream]):
                prompt_tokens = len(output.prompt_token_ids or [])
                cached_tokens = output.num_cached_tokens
                if not opened:
                    # Sent with the first output, as vLLM does: a client's time to first token is the
                    # time to this chunk, so it must not leave before the model produced anything.
                    opened = True
                    for chunk in self._opening_chunks(request, request_id, model):
                        chunk.usage = usage() if continuous else None
                        yield sse(chunk)
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    choice = ChatCompletionStreamChoice(
                        index=completion.index,
                        delta=reasoning.delta(
                            completion.index, completion.text, completion.finish_reason is not None
                        ),
                        logprobs=self._logprobs(request, completion),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                    if not _stream_tool_calls(tool_readers[completion.index], choice):
                        continue
                    chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice])
                    if continuous:
                        chunk.usage = usage()
                    yield sse(chunk)
            if include_usage:
                yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage()))
        except EngineDeadError as e:
            yield sse_error(engine_dead_error(e))
        except ValueError as e:  # rejected by the core at admission
            yield sse_error(_chat_error(request, request_error(e, PROMPT_PARAM, request.constraint_param())))
        yield SSE_DONE
