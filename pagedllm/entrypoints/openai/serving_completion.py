"""POST /v1/completions: prompts as a string, a list of strings, token ids or a list of token-id lists."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.input_processor import PromptType, TokensPrompt
from pagedllm.entrypoints.openai.cli_args import FrontendOptions
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from pagedllm.entrypoints.openai.request_limits import RequestLimits
from pagedllm.entrypoints.openai.serving_beam_search import (
    BeamSearchStream,
    beam_search_params,
    check_beam_search_request,
    start_beam_searches,
)
from pagedllm.entrypoints.openai.serving_logprobs import LogprobFormatter
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
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
from pagedllm.outputs import CompletionOutput, PromptLogprobs, RequestOutput

logger = logging.getLogger("pagedllm.entrypoints.openai")

PROMPT_PARAM = "prompt"


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]  # type: ignore[misc]
    raise OpenAIError(
        "prompt must be a string, a list of strings, token ids or a list of token-id lists", param="prompt"
    )


class OpenAIServingCompletion:
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        prompts: PromptTokenizer,
        limits: RequestLimits,
        options: FrontendOptions | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.prompts = prompts
        self.limits = limits
        self.options = options or FrontendOptions()

    def _check_supported(self, request: CompletionRequest) -> None:
        if request.suffix is not None:
            raise OpenAIError("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError("best_of is not supported (only best_of equal to n)", param="best_of")
        check_supported_fields(request, self.limits)
        # One list of token ids is one prompt (bounded by the context); any other list holds prompts.
        if isinstance(request.prompt, list) and request.prompt and not isinstance(request.prompt[0], int):
            self.limits.check_count("prompt", request.prompt)
        check_stream_options(request)
        check_prompt_logprobs(request)
        check_beam_search_request(request)
        if request.ignored_fields():
            logger.warning("Ignoring unknown completion fields: %s", ", ".join(request.ignored_fields()))

    async def _tokenized(self, request: CompletionRequest) -> list[TokensPrompt]:
        # Text prompts are tokenized here, off the event loop, rather than by the engine on it (a text
        # too long to fit the context is refused before that, truncate_prompt_tokens or not).
        tokenized: list[TokensPrompt] = []
        for p in _prompts(request.prompt):
            text = p if isinstance(p, str) else None
            if text is not None:
                ids = await self.prompts.encode(text, request.add_special_tokens, PROMPT_PARAM)
            else:
                ids = p["prompt_token_ids"]  # type: ignore[index]
            prompt: TokensPrompt = {
                "prompt_token_ids": truncate_prompt(ids, request, self.engine.max_model_len)
            }
            # The text goes with the ids unless truncation cut it (then the echo decodes what is left).
            if text is not None and len(prompt["prompt_token_ids"]) == len(ids):
                prompt["prompt"] = text
            tokenized.append(prompt)
        return tokenized

    async def create(
        self, request: CompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        model = self.models.check_model(request.model)
        self._check_supported(request)
        try:
            params = request.to_sampling_params()
        except ValueError as e:
            raise request_error(e, PROMPT_PARAM, request.constraint_param()) from e
        prompts = await self._tokenized(request)
        request_id, engine_id = response_id("cmpl", request)
        lora = self.models.lora_request(model)
        streams: list[RequestStream] | list[BeamSearchStream]
        if request.use_beam_search:
            max_tokens = request.max_tokens if request.max_tokens is not None else self.engine.max_model_len
            search = beam_search_params(request, max_tokens, self.engine.input_processor.max_logprobs)
            try:
                streams = start_beam_searches(self.engine, engine_id, prompts, search, lora)
            except ValueError as e:
                raise request_error(e, PROMPT_PARAM) from e
        else:
            streams = await start_requests(
                self.engine,
                engine_id,
                prompts,
                params,
                request.priority,
                PROMPT_PARAM,
                request.constraint_param(),
                trace_headers=trace_headers,
                lora_request=lora,
            )
        if request.stream:
            return self._stream(request, request_id, model, streams)
        return await self._full(request, request_id, model, streams)

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        return self.engine.tokenizer.decode(output.prompt_token_ids or [])

    async def _full(
        self, request: CompletionRequest, request_id: str, model: str, streams: list[RequestStream]
    ) -> CompletionResponse:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in merge_streams(streams):
                finals[index] = output
        except EngineDeadError as e:
            raise engine_dead_error(e) from e
        except ValueError as e:  # rejected by the core at admission
            raise request_error(e, PROMPT_PARAM, request.constraint_param()) from e
        choices: list[CompletionResponseChoice] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        logprobs = logprob_formatter(self.engine.tokenizer, self.options, request)
        for prompt_index, final in enumerate(finals):
            assert final is not None and final.finished
            prompt_text = self._prompt_text(final) if request.echo else ""
            prompt_tokens += len(final.prompt_token_ids or [])
            cached_tokens += final.num_cached_tokens
            echo_block = self._echo_logprobs(final, logprobs)
            # vLLM's prompt_logprobs (asked for by the field itself, not by echo), on each choice.
            asked = request.prompt_logprobs is not None and final.prompt_logprobs is not None
            prompt_logprobs = logprobs.prompt_logprobs(final.prompt_logprobs) if asked else None  # type: ignore[arg-type]
            for completion in final.outputs:
                completion_tokens += len(completion.token_ids)
                index = prompt_index * request.n + completion.index
                choice = self._choice(request, logprobs, index, completion, prompt_text, 0, echo_block)
                choice.prompt_logprobs = prompt_logprobs
                choices.append(choice)
        choices.sort(key=lambda c: c.index)
        usage = usage_info(self.options, prompt_tokens, completion_tokens, cached_tokens)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def _echo_logprobs(self, final: RequestOutput, logprobs: LogprobFormatter) -> CompletionLogProbs | None:
        """The echoed prompt's logprobs (None unless echo with logprobs asked the engine for them)."""
        if final.prompt_logprobs is None or final.prompt_token_ids is None:
            return None
        return logprobs.completion_block(final.prompt_token_ids, final.prompt_logprobs, 0)

    @staticmethod
    def _choice(
        request: CompletionRequest,
        formatter: LogprobFormatter,
        index: int,
        completion: CompletionOutput,
        prefix: str,
        offset: int,
        prefix_logprobs: CompletionLogProbs | None = None,
    ) -> CompletionResponseChoice:
        logprobs = None
        # echo with max_tokens 0: the prompt alone; the one token the engine sampled is not the answer.
        text = prefix if request.echo_only() else prefix + completion.text
        if request.logprobs is not None and completion.logprobs is not None:
            # Continue after the echoed prompt's tokens, on a copy: the n choices share the prompt's block.
            block = None if prefix_logprobs is None else prefix_logprobs.model_copy(deep=True)
            if request.echo_only():
                logprobs = block or CompletionLogProbs()
            else:
                if block is not None and block.tokens:
                    offset = block.text_offset[-1] + len(block.tokens[-1])
                logprobs = formatter.completion_block(
                    completion.token_ids, completion.logprobs, offset, block
                )
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    def _usage(
        self, prompt_tokens: list[int], completion_tokens: dict[int, int], cached: list[int]
    ) -> UsageInfo:
        return usage_info(self.options, sum(prompt_tokens), sum(completion_tokens.values()), sum(cached))

    async def _stream(
        self, request: CompletionRequest, request_id: str, model: str, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        include_usage, continuous = includes_usage(self.options, request)
        logprobs = logprob_formatter(self.engine.tokenizer, self.options, request)
        cached_tokens = [0] * len(streams)
        echo_logprobs = request.echo and request.logprobs is not None
        prompt_tokens = [0] * len(streams)
        # Per prompt: its logprobs so far (DELTA outputs bring them in pieces over a chunked prefill).
        prompt_logprobs: list[PromptLogprobs] = [[] for _ in streams]
        completion_tokens: dict[int, int] = {}
        echoed: set[int] = set()
        # Per choice not echoed yet: what it produced while its prompt's logprobs were incomplete.
        held: dict[int, CompletionOutput] = {}
        # Per choice: text_offset of its next token.
        offsets: dict[int, int] = {}
        try:
            async for prompt_index, output in merge_streams(streams):
                prompt_ids = output.prompt_token_ids or []
                prompt_tokens[prompt_index] = len(prompt_ids)
                cached_tokens[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index].extend(output.prompt_logprobs)
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    prefix, prefix_logprobs = "", None
                    if request.echo and index not in echoed:
                        completion = _join(held.pop(index, None), completion)
                        if (
                            echo_logprobs
                            and len(prompt_logprobs[prompt_index]) < len(prompt_ids)
                            and not completion.finished()
                        ):
                            # The echoed prompt and all its logprobs come first, as in the full response;
                            # with n > 1 another child may sample before the prompt's logprobs are in.
                            held[index] = completion
                            continue
                        echoed.add(index)
                        prefix = self._prompt_text(output)
                        if echo_logprobs:
                            prefix_logprobs = logprobs.completion_block(
                                prompt_ids, prompt_logprobs[prompt_index], 0
                            )
                    elif not (completion.text or completion.token_ids or completion.finished()):
                        continue  # only prompt logprobs of a prefill chunk: nothing for this choice
                    choice = self._choice(
                        request, logprobs, index, completion, prefix, offsets.get(index, 0), prefix_logprobs
                    )
                    if choice.logprobs is not None:
                        # Offsets count the tokens' texts, as the full response does (the detokenized
                        # text can differ in length, e.g. around a held-back stop string).
                        if choice.logprobs.tokens:
                            offsets[index] = choice.logprobs.text_offset[-1] + len(choice.logprobs.tokens[-1])
                    else:
                        offsets[index] = offsets.get(index, 0) + len(choice.text)
                    completion_tokens[index] = completion_tokens.get(index, 0) + len(completion.token_ids)
                    chunk = CompletionStreamResponse(id=request_id, model=model, choices=[choice])
                    if continuous:
                        chunk.usage = self._usage(prompt_tokens, completion_tokens, cached_tokens)
                    yield sse(chunk)
            if include_usage:
                usage = self._usage(prompt_tokens, completion_tokens, cached_tokens)
                yield sse(CompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage))
        except EngineDeadError as e:
            yield sse_error(engine_dead_error(e))
        except ValueError as e:  # rejected by the core at admission
            yield sse_error(request_error(e, PROMPT_PARAM, request.constraint_param()))
        yield SSE_DONE


def _join(earlier: CompletionOutput | None, later: CompletionOutput) -> CompletionOutput:
    """Two consecutive DELTA pieces of one choice as one."""
    if earlier is None:
        return later
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = [*(earlier.logprobs or []), *(later.logprobs or [])]
    return CompletionOutput(
        index=later.index,
        text=earlier.text + later.text,
        token_ids=[*earlier.token_ids, *later.token_ids],
        cumulative_logprob=later.cumulative_logprob,
        logprobs=logprobs,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
    )
