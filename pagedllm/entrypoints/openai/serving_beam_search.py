"""use_beam_search on /v1/completions and /v1/chat/completions: one beam search per prompt over the async
engine, answered as one finished output whose n choices are the n best beams (vLLM's server does the
same; a stream gets them in one chunk per choice at the end)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.beam_search import BeamSearch, beams_as_request_output, run_beam_search_async, step_params
from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.input_processor import TokensPrompt
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams

# Sampling fields a beam search cannot honour (it ranks the most likely tokens, unconstrained, and stops
# at EOS or the length only): given with beam search, they are refused rather than ignored.
_NOT_WITH_BEAM_SEARCH = (
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
    "stop", "stop_token_ids", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
    "prompt_logprobs", "include_stop_str_in_output", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools", "watermarking",
)  # fmt: skip


def check_beam_search_request(request: SamplingFields) -> None:
    """400 for a field that would do nothing: length_penalty without beam search, or a sampling field
    beam search ignores."""
    given = request.model_fields_set
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise OpenAIError(
                "length_penalty applies to beam search only (use_beam_search)", param="length_penalty"
            )
        return
    for name in _NOT_WITH_BEAM_SEARCH:
        if name in given and getattr(request, name, None) not in (None, [], {}):
            raise OpenAIError(f"{name} cannot be used with use_beam_search", param=name)


def beam_search_params(request: SamplingFields, max_tokens: int, max_logprobs: int) -> BeamSearchParams:
    """vLLM's mapping: n beams, the request's length_penalty, ignore_eos and temperature (0 unless
    given: the candidates are the most likely tokens, the sampled one adds no randomness then)."""
    if max_logprobs != -1 and 2 * request.n > max_logprobs:
        raise OpenAIError(
            f"n={request.n} beams need {2 * request.n} candidates per step, more than the model's "
            f"max_logprobs={max_logprobs}",
            param="n",
        )
    return BeamSearchParams(
        beam_width=request.n,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        temperature=request.temperature or 0.0,
        length_penalty=request.length_penalty,
    )


class BeamSearchStream:
    """Stands in for a RequestStream: runs the search when iterated and yields its one final output."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        search: BeamSearch,
        prompt: TokensPrompt,
        lora: LoRARequest | None,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.search = search
        self.prompt = prompt
        self.lora = lora
        self._steps: list[RequestStream] = []
        self._count = 0

    async def _generate(self, token_ids: list[list[int]], adapters: list[Any]) -> list[RequestOutput]:
        params = step_params(self.search.params)
        self._steps = []
        for ids in token_ids:
            self._count += 1
            self._steps.append(
                await self.engine.add_request(
                    f"{self.request_id}-beam{self._count}",
                    {"prompt_token_ids": ids},
                    params,
                    lora_request=self.lora,
                )
            )

        async def final(stream: RequestStream) -> RequestOutput:
            outputs = [output async for output in stream]
            return outputs[-1]  # type: ignore[return-value]

        results = await asyncio.gather(*(final(stream) for stream in self._steps))
        self._steps = []
        return list(results)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        await run_beam_search_async([self.search], self._generate)
        yield beams_as_request_output(
            self.request_id, self.prompt.get("prompt"), self.search, self.engine.tokenizer
        )

    def abort(self) -> None:
        for stream in self._steps:
            stream.abort()


def start_beam_searches(
    engine: AsyncLLM,
    request_id: str,
    prompts: list[TokensPrompt],
    params: BeamSearchParams,
    lora: LoRARequest | None,
) -> list[BeamSearchStream]:
    """One search per prompt (its parameters are checked here, before anything runs)."""
    processor = engine.input_processor
    streams = []
    for i, prompt in enumerate(prompts):
        search = BeamSearch(
            list(prompt["prompt_token_ids"]),
            params,
            None if params.ignore_eos else processor.eos_token_id,
            processor.max_model_len,
            lora,
        )
        sub_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        streams.append(BeamSearchStream(engine, sub_id, search, prompt, lora))
    return streams
