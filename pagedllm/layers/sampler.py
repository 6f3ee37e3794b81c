"""The sampler: one vectorized pass from the batch's logits to one token per request.

Steps (vLLM V1 order): raw logprobs (if asked) -> logit bias -> penalties -> bans (allowed_token_ids,
bad words, stop tokens under min_tokens) -> greedy argmax -> temperature -> min-p -> top-k/top-p ->
exponential race. Greedy and random rows share the batch; seeded rows draw from their own generators.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs, gather_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    random_sample,
)


@dataclass
class SamplerOutput:
    # [num_reqs] int64
    sampled_token_ids: torch.Tensor
    # Logprobs of the sampled token (column 0) and the batch's max_num_logprobs top tokens, from the
    # raw distribution (before any processing, vLLM's default "raw_logprobs"); None if no row asked.
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` [num_reqs, vocab] float32; modified in place."""
        raw_logprobs = compute_logprobs(logits) if metadata.max_num_logprobs is not None else None
        logits = self.process_logits(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """What changes the argmax too: bias, penalties and bans."""
        if metadata.logit_bias is not None:
            rows, ids, values = metadata.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if not metadata.no_penalties:
            assert metadata.output_token_ids is not None
            assert metadata.presence_penalties is not None and metadata.frequency_penalties is not None
            assert metadata.repetition_penalties is not None
            apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        # Bans last: -inf stays -inf under bias and penalties, so the order among these does not matter.
        if metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(metadata.allowed_token_ids_mask, float("-inf"))
        if metadata.banned is not None:
            logits.index_put_(metadata.banned, torch.tensor(float("-inf"), device=logits.device))
        return logits

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        assert metadata.temperature is not None
        logits = apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        sampled = random_sample(probs, metadata.generators)
        if greedy is None:
            return sampled
        assert metadata.greedy_mask is not None
        return torch.where(metadata.greedy_mask, greedy, sampled)
