"""The sampler: one vectorized pass from the batch's logits to one token per request.

Steps (vLLM V1 order): logprobs of the raw logits (if asked) -> logit bias -> penalties -> bans (allowed_token_ids,
bad words, stop tokens under min_tokens) -> greedy argmax -> temperature -> min-p -> top-k/top-p ->
exponential race. Greedy and random rows share the batch; seeded rows draw from their own generators.
Watermarked rows (`metadata.watermark`) get kgw's green bias after truncation, or race on keyed
exponentials instead of random ones (see pagedllm.sample.watermark).
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
from pagedllm.sample.watermark import gumbel_select

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class SamplerOutput:
    # [num_reqs] int64
    sampled_token_ids: torch.Tensor
    # The sampled token (column 0) and the batch's max_num_logprobs top tokens, with the sampled token's
    # rank; values as the sampler's logprobs_mode says. None if no row asked for logprobs.
    logprobs: LogprobsTensors | None


class Sampler(nn.Module):
    """``logprobs_mode`` (ModelConfig.logprobs_mode): "raw_logprobs" (vLLM's default: log-softmax of
    the model's logits), "raw_logits", or the "processed_" variants, taken after bias, penalties, bans,
    temperature and truncation (what the token was actually drawn from)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is not supported; use one of {LOGPROBS_MODES}")
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits`` [num_reqs, vocab] float32; modified in place."""
        raw = self.raw_logprobs(logits, metadata)
        logits = self.process_logits(logits, metadata)
        sampled, processed = self.sample(logits, metadata)
        return SamplerOutput(sampled, self.gather_logprobs(raw, processed, metadata, sampled))

    def raw_logprobs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor | None:
        """What the raw logprobs modes report, taken before any processing; None otherwise."""
        if metadata.max_num_logprobs is None:
            return None
        if self.logprobs_mode == "raw_logprobs":
            return compute_logprobs(logits)
        if self.logprobs_mode == "raw_logits":
            return logits.clone()
        return None

    def gather_logprobs(
        self,
        raw: torch.Tensor | None,
        processed: torch.Tensor,
        metadata: SamplingMetadata,
        token_ids: torch.Tensor,
    ) -> LogprobsTensors | None:
        """The logprobs of ``token_ids`` (one per row) and each row's top alternatives, from ``raw``
        (see raw_logprobs) or, in the processed modes, from the logits the tokens were drawn from."""
        if metadata.max_num_logprobs is None:
            return None
        if raw is None:
            raw = compute_logprobs(processed) if self.logprobs_mode == "processed_logprobs" else processed
        return gather_logprobs(raw, metadata.max_num_logprobs, token_ids)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """What changes the argmax too: bias, penalties and bans."""
        if metadata.logit_bias is not None:
            rows, ids, values = metadata.logit_bias
            logits.index_put_((rows, ids), values, accumulate=True)
        if not metadata.no_penalties:
            assert metadata.presence_penalties is not None and metadata.frequency_penalties is not None
            assert metadata.repetition_penalties is not None
            apply_penalties(
                logits,
                metadata.penalty_seen,
                metadata.penalty_output,
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
    def truncate(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, then min-p / top-k / top-p: the logits random rows draw from (in place)."""
        assert metadata.temperature is not None
        logits = apply_temperature(logits, metadata.temperature)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        return apply_top_k_top_p(logits, metadata.top_k, metadata.top_p, metadata.max_top_k)

    @staticmethod
    def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled ids and the logits they were drawn from (greedy rows: temperature 1, untruncated)."""
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy, logits
        logits = Sampler.truncate(logits, metadata)
        watermark = metadata.watermark
        if watermark is not None and watermark.green_bias is not None:
            logits.index_add_(0, watermark.rows, watermark.green_bias)
        probs = logits.softmax(dim=-1)
        marked = None
        if watermark is not None and watermark.exponentials is not None:
            # Before random_sample, which overwrites probs.
            rows = probs.index_select(0, watermark.rows)
            marked = (watermark.rows, gumbel_select(rows, watermark.exponentials))
        sampled = random_sample(probs, metadata.generators)
        if marked is not None:
            sampled.index_copy_(0, *marked)
        if greedy is None:
            return sampled, logits
        assert metadata.greedy_mask is not None
        return torch.where(metadata.greedy_mask, greedy, sampled), logits
