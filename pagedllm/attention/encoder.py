"""Bidirectional (encoder) attention over each sequence of the flattened batch, without a KV cache.

An encoder (BERT) attends over the whole prompt at once, so it never reads earlier steps' keys: the
scheduler runs each of its prompts in one step (see `pagedllm.config.pooler`), and the layer only needs
the step's sequence boundaries (`query_start_loc_cpu`). Sequences are padded into one batch for a single
SDPA call, the padding masked out of the keys; embedding prompts are short, so padding costs little."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionMetadata, AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.forward_context import get_forward_context


class EncoderOnlyMetadataBuilder(AttentionMetadataBuilder):
    """Metadata of a model with no paged attention layers: the common step inputs as they are."""

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        fields = {f.name: getattr(common, f.name) for f in dataclasses.fields(CommonAttentionMetadata)}
        return AttentionMetadata(**fields)


def _sequence_bounds(num_tokens: int) -> list[int]:
    md = get_forward_context().attn_metadata
    if md is None:  # profiling / warm-up: the whole batch is one sequence
        return [0, num_tokens]
    bounds = md.query_start_loc_cpu
    return list(bounds) if bounds is not None else md.query_start_loc.tolist()


def encoder_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, scale: float
) -> torch.Tensor:
    """`q`, `k`, `v` [T, num_heads * head_size] of the step's sequences -> [T, num_heads * head_size],
    each token attending to every token of its own sequence."""
    num_tokens = q.shape[0]
    head_size = q.shape[1] // num_heads
    bounds = _sequence_bounds(num_tokens)
    starts = torch.tensor(bounds[:-1], dtype=torch.int64, device=q.device)
    lens = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:])], dtype=torch.int64, device=q.device)
    max_len = int(lens.max())
    offsets = torch.arange(max_len, device=q.device)
    valid = offsets[None, :] < lens[:, None]  # [B, L]
    index = torch.where(valid, starts[:, None] + offsets[None, :], 0)

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x[index].view(*index.shape, num_heads, head_size).transpose(1, 2)  # [B, H, L, D]

    mask = valid[:, None, None, :]  # keys only: padded queries are dropped below
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask, scale=scale)
    return out.transpose(1, 2)[valid].reshape(num_tokens, num_heads * head_size)
