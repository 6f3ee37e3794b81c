"""The portable backend: paged attention in plain PyTorch tensor ops, on any device and dtype.

* Decode rows, all at once: "block-wise flash decoding". Every (row, cache block) pair becomes one
  batch entry: the blocks are gathered from the paged cache with one `index_select`, scores are a
  batched matmul `[B, kv_heads, group, head] x [B, kv_heads, head, block_size]`, and the softmax is
  done across each row's blocks with segment reductions (`scatter_reduce_` amax, `index_add_` sums).
  The only waste is the masked tail of each row's last block (< block_size keys), so the cost is
  linear in the tokens attended to, with a fixed number of kernel launches per layer and no Python
  work per request or per token.
* Prompt segments: one `scaled_dot_product_attention` per request, which runs torch's fused CPU
  flash-attention kernel (explicit scores where a soft cap must be applied to them). A fresh prompt
  attends to its own new keys directly (`is_causal`, no cache read); a chunk with a cached prefix
  gathers its blocks and uses a causal mask offset by the number of cached tokens. A per-request
  loop is cheap here: each iteration is a large kernel, and a step holds few prompt segments.

An fp8 cache (`fp8_kv`) is read dequantized to the activations' dtype; a fresh prompt attends its own
new keys and values as computed, before they are rounded to fp8. Every path applies the layer's
sliding window and logits soft cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention import fp8_kv
from pagedllm.attention.backend import AttentionImpl, CommonAttentionMetadata
from pagedllm.attention.backends.protocol import (
    AttentionFeatures,
    DecodeRows,
    LayerCall,
    PrefillSegment,
    StepClass,
)

# Query rows of a soft-capped prompt per explicit score matrix: bounds it to ~64 MiB of float32.
_SCORE_ELEMENTS = 1 << 24

# Cache element types the tensor ops read and write (fp8 through `fp8_kv`).
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def tensor_ops_unsupported(features: AttentionFeatures) -> str | None:
    """Why tensor ops cannot serve a layer: they store and read only float or fp8 caches."""
    if not features.dtype.is_floating_point:
        return f"activations of {features.dtype} are not floating point"
    if features.cache_dtype not in CACHE_DTYPES:
        return f"a {features.cache_dtype} KV cache is not one of {[str(d) for d in CACHE_DTYPES]}"
    return None


def query_rows(rows: DecodeRows, device: torch.device) -> torch.Tensor | None:
    """The decode rows' query rows as a tensor, or None when they are exactly rows 0..n-1."""
    if np.array_equal(rows.q_rows, np.arange(rows.q_rows.size)):
        return None
    return torch.from_numpy(rows.q_rows).to(device)


def store_slots(slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache block and offset of each new token, for `write_kv_tensors`."""
    return slots // block_size, slots % block_size


def write_kv_tensors(call: LayerCall, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Stores the step's keys and values at their (block, offset), through `[num_blocks,
    block_size, kv_heads, head]` views of the head-major blocks."""
    slot_block, slot_offset = plan
    cache, n = call.kv_cache, call.num_tokens
    fp8 = fp8_kv.is_fp8(cache.dtype)
    for i, new in enumerate((call.key[:n], call.value[:n])):
        stored = fp8_kv.quantize(new, call.kv_scales[i], cache.dtype) if fp8 else new.to(cache.dtype)
        cache[i].transpose(1, 2)[slot_block, slot_offset] = stored


def store_decode(o: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """Writes decode rows' outputs `o` to their query rows of `out`."""
    o = o.to(out.dtype)
    if rows is None:
        out[: o.shape[0]] = o
    else:
        out.index_copy_(0, rows, o)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x.index_select(0, index)` for a contiguous `x`, through a 2-D view: torch's CPU kernel copies
    whole rows with memcpy only for 2-D inputs, and is several times slower on the 4-D cache blocks."""
    return x.view(x.shape[0], -1).index_select(0, index).view(index.shape[0], *x.shape[1:])


def _segment_sum(x: torch.Tensor, segment: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Sums the rows of `x` per segment id, through 2-D views: torch's CPU `index_add_` is ~16x
    slower on 4-D tensors than on the same data viewed as rows."""
    flat = x.reshape(x.shape[0], -1)
    total = torch.zeros((num_segments, flat.shape[1]), dtype=x.dtype, device=x.device)
    return total.index_add_(0, segment, flat).view(num_segments, *x.shape[1:])


@dataclass
class BlockwiseDecodePlan:
    # Query row of each decode row, or None when they are exactly rows 0..n-1.
    rows: torch.Tensor | None
    num_rows: int
    # Per (decode row, block) entry: the decode row it belongs to, and the cache block id.
    row_of_block: torch.Tensor
    block_ids: torch.Tensor
    # [B, block_size]: which keys of the block the row may attend to.
    valid: torch.Tensor
    # Entries with masked keys (last blocks, sliding-window starts) and their masks: those value
    # rows are zeroed, since a never-written slot may hold NaN and 0 * NaN would poison the sum.
    tail: torch.Tensor
    tail_valid: torch.Tensor
    # True when every row has exactly one block: a plain softmax, no segment reductions.
    single_block: bool


def blockwise_decode_plan(
    common: CommonAttentionMetadata, rows: DecodeRows, window: int, block_size: int
) -> BlockwiseDecodePlan:
    """One entry per (row, cache block it reads); blocks wholly outside the window (0: none) are
    skipped, not just masked."""
    device = common.block_tables.device
    num_rows = int(rows.q_rows.size)
    dseq = rows.seq_lens
    reqs = torch.from_numpy(rows.reqs).to(device)
    first = np.maximum(dseq - window, 0) // block_size if window else np.zeros_like(dseq)
    nblk = (dseq - 1) // block_size - first + 1
    total = int(nblk.sum())
    row_of_block_np = np.repeat(np.arange(num_rows), nblk)
    blk_in_row_np = np.arange(total) - np.repeat(np.cumsum(nblk) - nblk, nblk) + first[row_of_block_np]

    pos = blk_in_row_np[:, None] * block_size + np.arange(block_size)
    seq_of_block = dseq[row_of_block_np][:, None]
    valid_np = pos < seq_of_block
    if window:
        valid_np &= pos >= seq_of_block - window
    tail_np = np.flatnonzero(~valid_np.all(axis=1))

    row_of_block = torch.from_numpy(row_of_block_np).to(device)
    blk_in_row = torch.from_numpy(blk_in_row_np).to(device)
    block_ids = common.block_tables[reqs.index_select(0, row_of_block), blk_in_row].long()
    valid = torch.from_numpy(valid_np).to(device)
    tail = torch.from_numpy(tail_np).to(device)
    return BlockwiseDecodePlan(
        query_rows(rows, device),
        num_rows,
        row_of_block,
        block_ids,
        valid,
        tail,
        valid.index_select(0, tail),
        bool((nblk == 1).all()),
    )


def causal_attention(
    impl: AttentionImpl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int
) -> torch.Tensor:
    """Causal attention of `q` [L, H, D] (positions num_computed..) over `k`/`v` [Hkv, S, D]
    (positions 0..S-1) with `impl`'s window and soft cap; returns [H, L, D]."""
    q_len, k_len = q.shape[0], k.shape[1]
    mask = None
    if num_computed > 0 or impl.sliding_window is not None or impl.logits_soft_cap is not None:
        q_pos = torch.arange(num_computed, num_computed + q_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if impl.sliding_window is not None:
            mask &= k_pos > q_pos - impl.sliding_window
    if impl.logits_soft_cap is not None:
        assert mask is not None
        return _soft_capped(impl, q.transpose(0, 1), k.to(q.dtype), v.to(q.dtype), mask)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.unsqueeze(0).to(q.dtype),
        v.unsqueeze(0).to(q.dtype),
        attn_mask=mask,
        is_causal=mask is None,
        scale=impl.scale,
        enable_gqa=impl.num_heads != impl.num_kv_heads,
    )
    return out.squeeze(0)


def _soft_capped(
    impl: AttentionImpl, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`causal_attention` with the soft cap applied to the scores, which SDPA cannot do: explicit
    float32 scores, a bounded number of query rows at a time. q [H, L, D], k/v [Hkv, S, D] -> [H, L, D]."""
    assert impl.logits_soft_cap is not None
    cap, group = impl.logits_soft_cap, impl.num_heads // impl.num_kv_heads
    kf = k.float().repeat_interleave(group, 0)  # [H, S, D]
    vf = v.float().repeat_interleave(group, 0)
    out = torch.empty_like(q)
    step = max(1, _SCORE_ELEMENTS // (q.shape[0] * k.shape[1]))
    for a in range(0, q.shape[1], step):
        scores = torch.matmul(q[:, a : a + step].float(), kf.transpose(1, 2)) * impl.scale
        scores = (torch.tanh(scores / cap) * cap).masked_fill_(~mask[a : a + step], float("-inf"))
        out[:, a : a + step] = torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)
    return out


class PortableAttention:
    """Tensor ops for every step class (see the module docstring)."""

    name = "portable"
    plans_per_window = True

    def unsupported(self, features: AttentionFeatures, step: StepClass) -> str | None:
        return tensor_ops_unsupported(features)

    def layer_state(self, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        return None

    def plan_decode(
        self, common: CommonAttentionMetadata, rows: DecodeRows, window: int, block_size: int, mixed: bool
    ) -> BlockwiseDecodePlan:
        return blockwise_decode_plan(common, rows, window, block_size)

    def stores_kv(self, plan: Any) -> bool:
        return False

    def plan_store(self, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return store_slots(slots, block_size)

    def write_kv(self, call: LayerCall, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        write_kv_tensors(call, plan)

    def plan_prompts(self, common: CommonAttentionMetadata, prefills: list[PrefillSegment]) -> None:
        return None

    def prefill(
        self, call: LayerCall, block_tables: torch.Tensor, prefills: list[PrefillSegment], plan: None
    ) -> None:
        query, key, value, kv_cache = call.query, call.key, call.value, call.kv_cache
        block_size = kv_cache.shape[3]
        for seg in prefills:
            q = query[seg.start : seg.end]
            if seg.num_computed == 0:
                k, v = key[seg.start : seg.end].transpose(0, 1), value[seg.start : seg.end].transpose(0, 1)
            else:
                nb = (seg.seq_len + block_size - 1) // block_size
                blocks = block_tables[seg.req, :nb].long()
                k, v = (
                    fp8_kv.dequantize(
                        _gather_sequence(kv_cache[i], blocks, seg.seq_len), call.kv_scales[i], q.dtype
                    )
                    for i in (0, 1)
                )
            out = causal_attention(call.impl, q, k, v, seg.num_computed)
            call.out[seg.start : seg.end] = out.transpose(0, 1)

    def decode(self, call: LayerCall, plan: BlockwiseDecodePlan) -> None:
        impl, query, kv_cache, kv_scales = call.impl, call.query, call.kv_cache, call.kv_scales
        p, group = plan, impl.num_heads // impl.num_kv_heads
        q = query[: p.num_rows] if p.rows is None else query.index_select(0, p.rows)
        q = (q * impl.scale).view(p.num_rows, impl.num_kv_heads, group, impl.head_size)
        # fp8 blocks are computed in the activations' dtype (no fp8 matrix products on CPU).
        dtype = query.dtype if fp8_kv.is_fp8(kv_cache.dtype) else kv_cache.dtype
        qb = _gather_rows(q.contiguous(), p.row_of_block).to(dtype)  # [B, Hkv, G, D]
        # Head-major blocks: both products below are plain batched GEMMs on the gathered blocks
        # (the key transpose is a BLAS flag), with no layout copies.
        kb = fp8_kv.dequantize(_gather_rows(kv_cache[0], p.block_ids), kv_scales[0], dtype)  # [B, Hkv, bs, D]
        vb = fp8_kv.dequantize(_gather_rows(kv_cache[1], p.block_ids), kv_scales[1], dtype)
        vb.index_copy_(0, p.tail, _gather_rows(vb, p.tail).masked_fill_(~p.tail_valid[:, None, :, None], 0))
        scores = torch.matmul(qb, kb.transpose(-1, -2)).float()  # [B, Hkv, G, bs]
        if impl.logits_soft_cap is not None:
            scores = torch.tanh(scores / impl.logits_soft_cap) * impl.logits_soft_cap
        scores.masked_fill_(~p.valid[:, None, None, :], float("-inf"))
        if p.single_block:
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs.to(vb.dtype), vb)
        else:
            blk_max = scores.amax(dim=-1)
            row_max = torch.full(
                (p.num_rows, *blk_max.shape[1:]), float("-inf"), dtype=blk_max.dtype, device=blk_max.device
            )
            index = p.row_of_block.view(-1, 1, 1).expand_as(blk_max)
            row_max.scatter_reduce_(0, index, blk_max, "amax")
            probs = torch.exp(scores - row_max.index_select(0, p.row_of_block).unsqueeze(-1))
            denom = _segment_sum(probs.sum(dim=-1), p.row_of_block, p.num_rows)
            o_blk = torch.matmul(probs.to(vb.dtype), vb).float()  # [B, Hkv, G, D]
            o = _segment_sum(o_blk, p.row_of_block, p.num_rows) / denom.unsqueeze(-1)
        store_decode(o.reshape(p.num_rows, impl.num_heads, impl.head_size), p.rows, call.out)


def _gather_sequence(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` keys (or values) of a request as `[kv_heads, seq_len, head]`."""
    gathered = _gather_rows(cache, blocks)  # [nb, Hkv, bs, D]
    return gathered.transpose(0, 1).flatten(1, 2)[:, :seq_len]


PORTABLE = PortableAttention()
