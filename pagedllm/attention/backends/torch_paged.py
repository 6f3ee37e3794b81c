"""Paged attention in plain PyTorch: the CPU backend and the portable fallback on CUDA.

One forward serves a flattened batch that mixes decodes, draft verification, whole prompts and
prompt chunks whose earlier tokens are already cached. No request is padded to the longest one; the
work is linear in the keys each query attends to. The builder (`torch_paged_metadata`) splits the
step into decode rows (every token of a request with at most `MAX_DECODE_QUERY_LEN` new tokens, each
with its own length) and prompt segments, and plans both once per step. The paths:

* Decode rows on CPU, in float32 or bfloat16 over a cache of that dtype or of fp8: the native kernel
  of `cpu_decode`, which reads each request's blocks where they lie (no gathered copy), one call for
  all rows. The other paths read an fp8 cache (`fp8_kv`) dequantized to the activations' dtype; a
  fresh prompt attends its own new keys and values as computed, before they are rounded to fp8.
* Decode rows elsewhere (CUDA, float16, no C compiler), all at once: "block-wise flash decoding".
  Every (row, cache block) pair becomes one batch entry: the blocks are gathered from the paged cache
  with one `index_select`, scores are a batched matmul `[B, kv_heads, group, head] x [B, kv_heads,
  head, block_size]`, and the softmax is done across each row's blocks with segment reductions
  (`scatter_reduce_` amax, `index_add_` sums). The only waste is the masked tail of each row's last
  block (< block_size keys), so the cost is linear in the tokens attended to, with a fixed number of
  kernel launches per layer and no Python work per request or per token.
* Prefill segments on CPU in bfloat16 (AVX512-BF16): the native prompt kernel of `cpu_decode`, one
  call for all segments, reading keys from the paged cache (stored first).
* Prefill segments elsewhere: one `scaled_dot_product_attention` per request, which runs torch's
  fused CPU flash-attention kernel (explicit scores where a soft cap must be applied to them). A fresh
  prompt attends to its own new keys directly (`is_causal`, no cache read); a chunk with a cached
  prefix gathers its blocks and uses a causal mask offset by the number of cached tokens. A
  per-request loop is cheap here: each iteration is a large kernel, and a step holds few prefill
  segments.

Every path applies the layer's sliding window and logits soft cap. The host-side planning (numpy on
the Python lists of lengths) and the prefill loop cannot be traced; under torch.compile the layer
calls this backend through the opaque `pagedllm::unified_attention` op, so the rest of the model
compiles as one graph. The same host work keeps this backend out of CUDA graph capture: a fused GPU
kernel backend is the way there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from pagedllm.attention import fp8_kv
from pagedllm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged_metadata import (
    BlockwiseDecodePlan,
    DenseDecodePlan,
    NativeDecodePlan,
    TorchPagedMetadata,
    TorchPagedMetadataBuilder,
    native_layout_for,
)

# Query rows of a soft-capped prompt per explicit score matrix: bounds it to ~64 MiB of float32.
_SCORE_ELEMENTS = 1 << 24


def native_decode_step(
    md: AttentionMetadata, block_size: int | None = None, window: int | None = None
) -> cpu_decode.DecodeStep | None:
    """The native kernel's arguments for a CPU step of decode rows only (each layer's call also
    stores the step's keys), built by the builder; None for a step with prompts or without a native
    plan. The step is the same for every block size and window (the layer's layout carries them):
    `block_size` and `window` are accepted for callers that name the layer they run."""
    return md.native_decode if isinstance(md, TorchPagedMetadata) else None


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Decode attention of `q` [R, Hkv, G, D] over each row's blocks (`block_tables` [R, MB] into
    head-major caches [NB, Hkv, bs, D]) written as plain tensor ops, for Inductor to fuse the block
    gathers into its loads: no gathered copy of the keys or values is ever materialized. `window`
    and `soft_cap` are 0 for none; the elements read as `cache * kv_scales[i]` (1.0 but in fp8)."""
    num_blocks = block_tables.shape[1]
    block_size = k_cache.shape[2]
    k = k_cache[block_tables].float() * kv_scales[0]  # [R, MB, Hkv, bs, D]
    scores = (q.float()[:, None, :, :, None, :] * k[:, :, :, None, :, :]).sum(-1) * scale  # [R,MB,Hkv,G,bs]
    if soft_cap > 0:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    pos = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, block_size)
    valid = pos[None] < seq_lens[:, None, None]
    if window > 0:
        valid &= pos[None] >= (seq_lens - window)[:, None, None]
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))
    # Masked slots are zeroed, not just weighted 0: a never-written slot may hold NaN (0 * NaN = NaN).
    v = (v_cache[block_tables].float() * kv_scales[1]).masked_fill(~valid[:, :, None, :, None], 0.0)
    out = (probs[..., None] * v[:, :, :, None, :, :]).sum(dim=(1, 4))  # [R, Hkv, G, D]
    return (out / probs.sum(dim=(1, 4))[..., None]).to(q.dtype)


@functools.cache
def _compiled_dense_decode(kind: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
    # One compiled function per kind of layer (its parameters, cache dtype and block size), each
    # with its own recompile budget (`isolate_recompiles`): a kind needs up to four graphs (one or
    # more rows, one or more blocks), and layers of other windows, soft caps, head layouts or dtypes
    # in the process no longer count against it.
    return torch.compile(
        dense_decode, fullgraph=True, dynamic=False, recompile_limit=64, isolate_recompiles=True
    )


def _run_compiled_dense(kind: tuple[Any, ...], *args: Any) -> torch.Tensor:
    q, k_cache, v_cache, _, block_tables, seq_lens = args[:6]
    # Rows, cache blocks and table width vary per step: one graph serves them all. Sizes of 1
    # (a single row, a single block) are specialized by Dynamo into graphs of their own.
    for t, dims in ((q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (block_tables, (0, 1)), (seq_lens, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled_dense_decode(kind)(*args)


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


class TorchPagedAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata | None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:
            return self._prefill(query, key.transpose(0, 1), value.transpose(0, 1), 0).transpose(0, 1)
        md = attn_metadata
        entry = md.layer_plans.get(self) if isinstance(md, TorchPagedMetadata) else None
        if entry is None:
            raise RuntimeError(
                "the step's attention metadata was not built for this layer: build it with "
                "TorchPagedMetadataBuilder over the model's attention layers (after bind_kv_cache)"
            )
        layout, plan = entry
        n = md.num_actual_tokens
        fp8 = fp8_kv.is_fp8(kv_cache.dtype)
        if kv_scales is None:
            kv_scales = torch.ones(2, device=kv_cache.device)
        if fp8 and md.calculate_kv_scales:
            kv_scales.copy_(fp8_kv.scales_from(key[:n], value[:n], kv_cache.dtype))
        out = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)

        # Write first, so decode rows and cached-prefix chunks read this step's keys too (in a step
        # of decode rows only the native kernel's call stores them itself).
        prefills = plan.prefills
        if layout is not None:
            if query.dtype != layout.dtype:
                raise TypeError(
                    f"{query.dtype} activations over a {layout.dtype} cache reached the native kernel"
                )
            if not (isinstance(plan.decode, NativeDecodePlan) and plan.decode.step.stores_kv):
                cpu_decode.write_kv(key[:n], value[:n], kv_cache, md.slot_mapping[:n], kv_scales)
            if layout.prefill_fn and plan.native_prefill:
                cpu_decode.prefill_layer(query, kv_cache, out, plan.native_prefill, layout)
                prefills = []
        else:
            assert plan.slot_block is not None and plan.slot_offset is not None
            # `[num_blocks, block_size, kv_heads, head]` views of the head-major blocks.
            for i, new in enumerate((key[:n], value[:n])):
                stored = fp8_kv.quantize(new, kv_scales[i], kv_cache.dtype) if fp8 else new.to(kv_cache.dtype)
                kv_cache[i].transpose(1, 2)[plan.slot_block, plan.slot_offset] = stored

        block_size = kv_cache.shape[3]
        for seg in prefills:
            q = query[seg.start : seg.end]
            if seg.num_computed == 0:
                k, v = key[seg.start : seg.end].transpose(0, 1), value[seg.start : seg.end].transpose(0, 1)
            else:
                nb = (seg.seq_len + block_size - 1) // block_size
                blocks = md.block_tables[seg.req, :nb].long()
                k, v = (
                    fp8_kv.dequantize(
                        self._gather_sequence(kv_cache[i], blocks, seg.seq_len), kv_scales[i], q.dtype
                    )
                    for i in (0, 1)
                )
            out[seg.start : seg.end] = self._prefill(q, k, v, seg.num_computed).transpose(0, 1)
        if plan.decode is not None:
            self._decode(query, key, value, kv_cache, kv_scales, plan.decode, layout, out)
        return out

    def native_layout(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
    ) -> cpu_decode.DecodeLayout | bool:
        """The kernel's view of this layer for these tensors, or False where the native kernel
        cannot serve it."""
        rows_ok = all(
            t.dtype == query.dtype and t.stride(-1) == 1 and t.stride(-2) == self.head_size
            for t in (query, key, value)
        )
        layout = native_layout_for(self, kv_cache, query.dtype) if rows_ok else None
        return layout if layout is not None else False

    @staticmethod
    def _gather_sequence(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The first `seq_len` keys (or values) of a request as `[kv_heads, seq_len, head]`."""
        gathered = _gather_rows(cache, blocks)  # [nb, Hkv, bs, D]
        return gathered.transpose(0, 1).flatten(1, 2)[:, :seq_len]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_computed: int) -> torch.Tensor:
        """Causal attention of `q` [L, H, D] (positions num_computed..) over `k`/`v` [Hkv, S, D]
        (positions 0..S-1); returns [H, L, D]."""
        q_len, k_len = q.shape[0], k.shape[1]
        mask = None
        if num_computed > 0 or self.sliding_window is not None or self.logits_soft_cap is not None:
            q_pos = torch.arange(num_computed, num_computed + q_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        if self.logits_soft_cap is not None:
            assert mask is not None
            return self._soft_capped_prefill(q.transpose(0, 1), k.to(q.dtype), v.to(q.dtype), mask)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.unsqueeze(0).to(q.dtype),
            v.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0)

    def _soft_capped_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`_prefill` with the soft cap applied to the scores, which SDPA cannot do: explicit float32
        scores, a bounded number of query rows at a time. q [H, L, D], k/v [Hkv, S, D] -> [H, L, D]."""
        assert self.logits_soft_cap is not None
        cap, group = self.logits_soft_cap, self.num_heads // self.num_kv_heads
        kf = k.float().repeat_interleave(group, 0)  # [H, S, D]
        vf = v.float().repeat_interleave(group, 0)
        out = torch.empty_like(q)
        step = max(1, _SCORE_ELEMENTS // (q.shape[0] * k.shape[1]))
        for a in range(0, q.shape[1], step):
            scores = torch.matmul(q[:, a : a + step].float(), kf.transpose(1, 2)) * self.scale
            scores = (torch.tanh(scores / cap) * cap).masked_fill_(~mask[a : a + step], float("-inf"))
            out[:, a : a + step] = torch.matmul(torch.softmax(scores, dim=-1), vf).to(q.dtype)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        kv_scales: torch.Tensor,
        p: BlockwiseDecodePlan | DenseDecodePlan | NativeDecodePlan,
        layout: cpu_decode.DecodeLayout | None,
        out: torch.Tensor,
    ) -> None:
        if isinstance(p, NativeDecodePlan):
            assert layout is not None
            cpu_decode.decode_layer(query, key, value, kv_cache, kv_scales, out, p.step, layout)
            return
        group = self.num_heads // self.num_kv_heads
        q = query[: p.num_rows] if p.rows is None else query.index_select(0, p.rows)
        if isinstance(p, DenseDecodePlan):
            q = q.reshape(p.num_rows, self.num_kv_heads, group, self.head_size)
            window, cap = self.params.sliding_window, self.params.logits_soft_cap
            kind = (self.params, kv_cache.dtype, kv_cache.shape[3])
            o = _run_compiled_dense(
                kind,
                q,
                kv_cache[0],
                kv_cache[1],
                kv_scales,
                p.block_tables,
                p.seq_lens,
                self.scale,
                window,
                cap,
            )
            self._store_decode(o.reshape(p.num_rows, self.num_heads, self.head_size), p.rows, out)
            return
        q = (q * self.scale).view(p.num_rows, self.num_kv_heads, group, self.head_size)
        # fp8 blocks are computed in the activations' dtype (no fp8 matrix products on CPU).
        dtype = query.dtype if fp8_kv.is_fp8(kv_cache.dtype) else kv_cache.dtype
        qb = _gather_rows(q.contiguous(), p.row_of_block).to(dtype)  # [B, Hkv, G, D]
        # Head-major blocks: both products below are plain batched GEMMs on the gathered blocks
        # (the key transpose is a BLAS flag), with no layout copies.
        kb = fp8_kv.dequantize(_gather_rows(kv_cache[0], p.block_ids), kv_scales[0], dtype)  # [B, Hkv, bs, D]
        vb = fp8_kv.dequantize(_gather_rows(kv_cache[1], p.block_ids), kv_scales[1], dtype)
        vb.index_copy_(0, p.tail, _gather_rows(vb, p.tail).masked_fill_(~p.tail_valid[:, None, :, None], 0))
        scores = torch.matmul(qb, kb.transpose(-1, -2)).float()  # [B, Hkv, G, bs]
        if self.logits_soft_cap is not None:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
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
        self._store_decode(o.reshape(p.num_rows, self.num_heads, self.head_size), p.rows, out)

    @staticmethod
    def _store_decode(o: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor) -> None:
        o = o.to(out.dtype)
        if rows is None:
            out[: o.shape[0]] = o
        else:
            out.index_copy_(0, rows, o)


class TorchPagedAttentionBackend(AttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchPagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TorchPagedMetadataBuilder]:
        return TorchPagedMetadataBuilder

    @staticmethod
    def warm_up(device: torch.device) -> None:
        if device.type == "cpu":
            cpu_decode.kernel()  # the first build runs the C compiler (seconds); later starts load it
