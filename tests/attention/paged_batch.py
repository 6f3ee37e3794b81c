"""Test helper: a paged KV cache plus hand-built step inputs for arbitrary mixed steps, turned into
the backend's metadata by its builder over the batch's layers.

Blocks are handed out from a shuffled free list, so every request's block table is non-contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention import (
    AttentionImpl,
    AttentionMetadata,
    CommonAttentionMetadata,
    attention_layers,
    bind_kv_cache,
    get_attn_backend,
)
from pagedllm.attention.backend import AttentionLayer
from pagedllm.forward_context import set_forward_context


@dataclass
class BoundImpl:
    """An impl and its cache, as a builder reads a layer."""

    impl: AttentionImpl
    kv_cache: torch.Tensor


class PagedBatch:
    # Builder flag for the backend's compiled kernels (the runner sets it at O1 and up).
    compiled_decode = False

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the activations'; the cache's is `cache_dtype`, by default the same."""
        self.block_size = block_size
        self.dtype = dtype
        # The layers the metadata is built for (`for_model`, `for_impls`).
        self.layers: list[AttentionLayer] = []
        # NaN-filled: a read of a slot that was never written poisons the output.
        self.kv_caches = [
            torch.full(
                get_attn_backend().get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size),
                float("nan"),
                dtype=cache_dtype or dtype,
            )
            for _ in range(num_layers)
        ]
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    @classmethod
    def for_model(cls, model: nn.Module, **kwargs: int | torch.dtype | None) -> PagedBatch:
        layers = list(attention_layers(model).values())
        first = layers[0]
        batch = cls(len(layers), first.num_kv_heads, first.head_size, **kwargs)  # type: ignore[arg-type]
        bind_kv_cache(model, batch.kv_caches)
        batch.layers = layers  # type: ignore[assignment]
        return batch

    @classmethod
    def for_impls(cls, impls: list[AttentionImpl], **kwargs: int | torch.dtype) -> PagedBatch:
        """One cache per impl (all of the first impl's kv head layout)."""
        batch = cls(len(impls), impls[0].num_kv_heads, impls[0].head_size, **kwargs)  # type: ignore[arg-type]
        batch.layers = [BoundImpl(impl, cache) for impl, cache in zip(impls, batch.kv_caches)]
        return batch

    def metadata(self, chunks: list[tuple[str, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Schedule `num_new` tokens for each `(request, num_new)`; returns positions and metadata,
        and advances each request's computed count."""
        positions, slots, qsl, seq_lens, computed = [], [], [0], [], []
        for req, n in chunks:
            start = self.computed.setdefault(req, 0)
            blocks = self.blocks.setdefault(req, [])
            while len(blocks) * self.block_size < start + n:
                blocks.append(self.free.pop())
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            computed.append(start)
            self.computed[req] = start + n
        width = max(len(self.blocks[r]) for r, _ in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, (req, _) in enumerate(chunks):
            tables[i, : len(self.blocks[req])] = torch.tensor(self.blocks[req], dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_actual_tokens=len(positions),
            num_reqs=len(chunks),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            num_computed_tokens=torch.tensor(computed, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(n for _, n in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        builder = get_attn_backend().get_builder_cls()(
            self.layers, self.dtype, torch.device("cpu"), self.compiled_decode
        )
        return torch.tensor(positions, dtype=torch.int64), builder.build(common)

    def run(self, model: nn.Module, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """One forward over the given new tokens; returns each request's logits for its new tokens."""
        positions, md = self.metadata([(req, len(toks)) for req, toks in chunks])
        input_ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.int64)
        with torch.no_grad(), set_forward_context(md):
            logits = model.compute_logits(model(input_ids, positions))
        bounds = md.query_start_loc_cpu
        assert bounds is not None
        return [logits[bounds[i] : bounds[i + 1]] for i in range(len(chunks))]


def shuffled_block_tables(cache: torch.Tensor, lengths: list[int], gen: torch.Generator) -> torch.Tensor:
    """Block tables (int32) giving request i the lengths[i] keys of `cache` ([2, num_blocks, kv_heads,
    block, head], block 0 unused) in shuffled blocks; slots past a request's keys are set to NaN,
    which a kernel must never sum."""
    block = cache.shape[3]
    blocks = [(n + block - 1) // block for n in lengths]
    order = torch.randperm(cache.shape[1] - 1, generator=gen) + 1
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    used = 0
    for i, (n, b) in enumerate(zip(lengths, blocks, strict=True)):
        tables[i, :b] = order[used : used + b].int()
        used += b
        if n % block:
            cache[:, tables[i, b - 1], :, n % block :] = float("nan")
    return tables
