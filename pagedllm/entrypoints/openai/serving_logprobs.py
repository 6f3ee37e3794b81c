"""Log probabilities in the response shapes: OpenAI's legacy completion block, the chat content list and
vLLM's prompt_logprobs, with tokens written as text or (return_tokens_as_token_ids) as "token_id:<id>"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagedllm.entrypoints.openai.protocol import CompletionLogProbs
from pagedllm.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
)
from pagedllm.outputs import Logprob, PromptLogprobs

# What JSON cannot carry (-inf, a token masked out) is written as OpenAI does.
_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return _FLOOR if math.isnan(logprob) else max(logprob, _FLOOR)


class LogprobFormatter:
    """Writes one request's logprobs; ``as_token_ids`` names tokens "token_id:<id>" (vLLM's
    return_tokens_as_token_ids), so that a token that is no text on its own can still be identified."""

    def __init__(self, tokenizer: Any, as_token_ids: bool) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def token(self, token_id: int, logprob: Logprob | None) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def completion_block(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[dict[int, Logprob] | None],
        start_offset: int,
        block: CompletionLogProbs | None = None,
    ) -> CompletionLogProbs:
        """OpenAI's legacy logprobs for ``token_ids``, appended to ``block`` if given. A None entry (the
        first prompt token, which nothing predicts) gets null logprobs, as in OpenAI's echo responses."""
        block = CompletionLogProbs() if block is None else block
        offset = start_offset
        for token_id, entries in zip(token_ids, logprobs):
            sampled = None if entries is None else entries.get(token_id)
            text = self.token(token_id, sampled)
            block.tokens.append(text)
            block.token_logprobs.append(None if sampled is None else _finite(sampled.logprob))
            block.top_logprobs.append(
                None
                if entries is None
                else {self.token(tid, lp): _finite(lp.logprob) for tid, lp in entries.items()}
            )
            block.text_offset.append(offset)
            offset += len(text)
        return block

    def chat_content(
        self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], top_n: int
    ) -> ChatCompletionLogProbs:
        content: list[ChatCompletionLogProbsContent] = []
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            text = self.token(token_id, sampled)
            ranked = sorted(
                entries.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30
            )
            content.append(
                ChatCompletionLogProbsContent(
                    token=text,
                    logprob=_FLOOR if sampled is None else _finite(sampled.logprob),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(t := self.token(tid, lp)),
                            logprob=_finite(lp.logprob),
                            bytes=list(t.encode("utf-8")),
                        )
                        for tid, lp in ranked[:top_n]
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def prompt_logprobs(self, logprobs: PromptLogprobs) -> list[dict[int, dict[str, Any]] | None]:
        """vLLM's prompt_logprobs: per prompt token None (the first) or token id -> {logprob, rank,
        decoded_token}, the prompt's own token among them."""
        return [
            None
            if entries is None
            else {
                tid: {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": self.token(tid, lp)}
                for tid, lp in entries.items()
            }
            for entries in logprobs
        ]
