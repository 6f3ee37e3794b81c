"""POST /tokenize (a prompt, or chat messages rendered with the template) and POST /detokenize."""

from __future__ import annotations

import asyncio

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.chat_rendering import ChatPromptRenderer
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.protocol_chat import TokenizeChatRequest
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_utils import PromptTokenizer


class OpenAIServingTokenization:
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        prompts: PromptTokenizer,
        chat_renderer: ChatPromptRenderer,
    ) -> None:
        self.engine = engine
        self.models = models
        self.prompts = prompts
        self.chat_renderer = chat_renderer

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.models.check_model(request.model)
        # Off the event loop, and bounded as prompts are: /tokenize of a text that cannot fit the context
        # would only build a huge answer.
        if isinstance(request, TokenizeChatRequest):
            text = await self.chat_renderer.render(
                request.messages,
                request.chat_template,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
            tokens = await self.prompts.encode(text, request.add_special_tokens, "messages")
        else:
            tokens = await self.prompts.encode(request.prompt, request.add_special_tokens, "prompt")
        token_strs = (
            self.engine.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        )
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens, token_strs=token_strs
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        vocab_size = self.engine.input_processor.vocab_size
        bad = sorted({t for t in request.tokens if not 0 <= t < vocab_size})
        if bad:
            raise OpenAIError(
                f"tokens contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}",
                param="tokens",
            )
        return DetokenizeResponse(
            prompt=await asyncio.to_thread(self.engine.tokenizer.decode, request.tokens)
        )
