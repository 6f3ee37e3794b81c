"""POST /tokenize (a prompt, or chat messages rendered with the template) and POST /detokenize."""

from __future__ import annotations

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_chat import render_chat_prompt
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat_template: str | None) -> None:
        self.engine = engine
        self.models = models
        self.chat_template = chat_template

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.models.check_model(request.model)
        tokenizer = self.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            _, tokens = render_chat_prompt(
                tokenizer,
                request.messages,
                request.chat_template or self.chat_template,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                request.add_special_tokens,
            )
        else:
            tokens = list(tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens))
        return TokenizeResponse(count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        vocab_size = self.engine.input_processor.vocab_size
        bad = sorted({t for t in request.tokens if not 0 <= t < vocab_size})
        if bad:
            raise OpenAIError(
                f"tokens contains token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.engine.tokenizer.decode(request.tokens))
