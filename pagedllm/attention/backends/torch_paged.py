"""Paged attention in plain PyTorch: the CPU backend and the portable fallback on CUDA.

One forward serves a flattened batch that mixes decodes, whole prompts and prompt chunks whose
earlier tokens are already cached. No request is padded to the longest one; the work is linear in
the keys each query attends to. The paths, chosen per request from host-side lengths:

* Decode rows (query length 1) on CPU, in float32 or bfloat16: the native kernel of `cpu_decode`,
  which reads each request's blocks where they lie (no gathered copy), one call for all requests.
* Decode rows elsewhere (CUDA, float16, no C compiler), all requests at once: "block-wise flash
  decoding". Every (request, cache block) pair becomes one batch entry: the blocks are gathered from
  the paged cache with one `index_select`, scores are a batched matmul `[B, kv_heads, group, head] x
  [B, kv_heads, head, block_size]`, and the softmax is done across each request's blocks with segment
  reductions (`scatter_reduce_` amax, `index_add_` sums). The only waste is the masked tail of each request's
  last block (< block_size keys), so the cost is linear in the tokens attended to, with a fixed
  number of kernel launches per layer and no Python work per request or per token.
* Prefill segments (query length > 1) on CPU in bfloat16 (AVX512-BF16): the native prompt kernel
  of `cpu_decode`, one call for all segments, reading keys from the paged cache (stored first).
* Prefill segments elsewhere: one `scaled_dot_product_attention` per request, which runs torch's
  fused CPU flash-attention kernel. A fresh prompt attends to its own new keys directly
  (`is_causal`, no cache read); a chunk with a cached prefix gathers its blocks and uses a causal mask
  offset by the number of cached tokens. A per-request loop is cheap here: each iteration is a large
  kernel, and a step holds few prefill segments.

The index tensors both paths need are computed once per step (on the first layer) and kept in
`AttentionMetadata.backend_cache`. The host-side plan (numpy on the Python lists of lengths) and the
prefill loop cannot be traced; under torch.compile the layer calls this backend through the opaque
`pagedllm::unified_attention` op, so the rest of the model compiles as one graph. The same host work
keeps this backend out of CUDA graph capture: a fused GPU kernel backend is the way there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends import cpu_decode


@dataclass
class _DecodePlan:
    # Query row of each decode request, or None when they are exactly rows 0..n-1.
    rows: torch.Tensor | None
    num_reqs: int
    # Per (request, block) entry: the decode request it belongs to, and the cache block id.
    req_of_block: torch.Tensor
    block_ids: torch.Tensor
    # [B, block_size]: which keys of the block the request may attend to.
    valid: torch.Tensor
    # Entries with masked keys (last blocks, sliding-window starts) and their masks: those value
    # rows are zeroed, since a never-written slot may hold NaN and 0 * NaN would poison the sum.
    tail: torch.Tensor
    tail_valid: torch.Tensor
    # True when every request has exactly one block: a plain softmax, no segment reductions.
    single_block: bool


@dataclass
class _DenseDecodePlan:
    """A few decode requests for the compiled kernel: query rows, their block-table rows (padded with
    block 0, masked out by `seq_lens`) and their lengths."""

    rows: torch.Tensor | None
    num_reqs: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class _NativeDecodePlan:
    """Decode requests for the native CPU kernel. In a step without prompts each layer's kernel
    call also stores the step's keys (`step` carries the slots); otherwise they are stored first."""

    step: cpu_decode.DecodeStep


@dataclass
class _PrefillSegment:
    req: int
    start: int
    end: int
    num_computed: int
    seq_len: int


@dataclass
class _Plan:
    decode: _DecodePlan | _DenseDecodePlan | _NativeDecodePlan | None
    prefills: list[_PrefillSegment]
    # The prompt segments for the native prompt kernel (native path only; layers whose layout it
    # does not serve loop over `prefills`).
    native_prefill: cpu_decode.PrefillStep | None
    # Cache block and offset of each new token (from slot_mapping), for the tensor-op write; None on
    # the native path, whose kernels take the slots themselves.
    slot_block: torch.Tensor | None
    slot_offset: torch.Tensor | None


def _build_plan(
    md: AttentionMetadata, block_size: int, window: int | None, device: torch.device, native: bool
) -> _Plan:
    qsl = np.asarray(
        md.query_start_loc_cpu if md.query_start_loc_cpu is not None else md.query_start_loc.tolist(),
        dtype=np.int64,
    )
    seq = np.asarray(md.seq_lens_cpu if md.seq_lens_cpu is not None else md.seq_lens.tolist(), dtype=np.int64)
    qsl, seq = qsl[: md.num_reqs + 1], seq[: md.num_reqs]
    q_lens = np.diff(qsl)
    dec = np.flatnonzero(q_lens == 1)
    prefills = [
        _PrefillSegment(int(i), int(qsl[i]), int(qsl[i + 1]), int(seq[i] - q_lens[i]), int(seq[i]))
        for i in np.flatnonzero(q_lens > 1)
    ]
    slots = md.slot_mapping[: md.num_actual_tokens]
    slot_block, slot_offset = (None, None) if native else (slots // block_size, slots % block_size)
    native_prefill = None
    if native and prefills:
        segments = [[s.start, s.end - s.start, s.num_computed, s.req] for s in prefills]
        native_prefill = cpu_decode.PrefillStep(md.block_tables, torch.tensor(segments, dtype=torch.int64))
    if dec.size == 0:
        return _Plan(None, prefills, native_prefill, slot_block, slot_offset)
    dseq = seq[dec]
    if native:
        step = cpu_decode.DecodeStep(
            md.block_tables,
            torch.from_numpy(qsl[dec]),
            torch.from_numpy(dec),
            torch.from_numpy(dseq),
            None if prefills else slots,
        )
        return _Plan(_NativeDecodePlan(step), prefills, native_prefill, slot_block, slot_offset)
    contiguous = bool(np.array_equal(qsl[dec], np.arange(dec.size)))
    rows = None if contiguous else torch.from_numpy(qsl[dec]).to(device)
    if md.compiled_decode and dec.size <= DENSE_DECODE_MAX_REQS:
        dec_t = torch.from_numpy(dec).to(device)
        max_blocks = int((dseq.max() + block_size - 1) // block_size)
        tables = md.block_tables.index_select(0, dec_t)[:, :max_blocks].long()
        dense = _DenseDecodePlan(rows, int(dec.size), tables, torch.from_numpy(dseq).to(device))
        return _Plan(dense, prefills, native_prefill, slot_block, slot_offset)
    # Blocks wholly outside the sliding window are skipped, not just masked.
    first = np.maximum(dseq - window, 0) // block_size if window is not None else np.zeros_like(dseq)
    nblk = (dseq - 1) // block_size - first + 1
    total = int(nblk.sum())
    req_of_block_np = np.repeat(np.arange(dec.size), nblk)
    blk_in_req_np = np.arange(total) - np.repeat(np.cumsum(nblk) - nblk, nblk) + first[req_of_block_np]

    pos = blk_in_req_np[:, None] * block_size + np.arange(block_size)
    seq_of_block = dseq[req_of_block_np][:, None]
    valid_np = pos < seq_of_block
    if window is not None:
        valid_np &= pos >= seq_of_block - window
    tail_np = np.flatnonzero(~valid_np.all(axis=1))

    req_of_block = torch.from_numpy(req_of_block_np).to(device)
    dec_t = torch.from_numpy(dec).to(device)
    blk_in_req = torch.from_numpy(blk_in_req_np).to(device)
    block_ids = md.block_tables[dec_t.index_select(0, req_of_block), blk_in_req].long()
    valid = torch.from_numpy(valid_np).to(device)
    tail = torch.from_numpy(tail_np).to(device)
    decode = _DecodePlan(
        rows,
        int(dec.size),
        req_of_block,
        block_ids,
        valid,
        tail,
        valid.index_select(0, tail),
        bool((nblk == 1).all()),
    )
    return _Plan(decode, prefills, native_prefill, slot_block, slot_offset)


# Decode steps of at most this many requests run the compiled dense kernel when it is enabled: it
# needs no per-block bookkeeping ops, which dominate when there are few requests (one request's decode
# over 512 keys: 0.08 ms per layer against 0.35 ms for the block-wise path on 2 Zen 4 cores); with many
# requests its padding to the longest table costs more than it saves.
DENSE_DECODE_MAX_REQS = 8


def _step_plan(
    md: AttentionMetadata, block_size: int, window: int | None, device: torch.device, native: bool
) -> _Plan:
    """The step's plan for layers of this block size and window, built by the first that asks."""
    key = ("torch_paged", block_size, window, native)
    plan = md.backend_cache.get(key)
    if plan is None:
        plan = md.backend_cache[key] = _build_plan(md, block_size, window, device, native)
    return plan


def native_decode_step(
    md: AttentionMetadata, block_size: int, window: int | None
) -> cpu_decode.DecodeStep | None:
    """The native kernel's arguments for a CPU step of decodes only (each layer's call also stores
    the step's keys), shared with the attention layers' plan; None for a step with prompts."""
    plan = _step_plan(md, block_size, window, torch.device("cpu"), native=True)
    if plan.prefills or not isinstance(plan.decode, _NativeDecodePlan):
        return None
    return plan.decode.step


def dense_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Decode attention of `q` [R, Hkv, G, D] over each request's blocks (`block_tables` [R, MB] into
    head-major caches [NB, Hkv, bs, D]) written as plain tensor ops, for Inductor to fuse the block
    gathers into its loads: no gathered copy of the keys or values is ever materialized."""
    num_blocks = block_tables.shape[1]
    block_size = k_cache.shape[2]
    k = k_cache[block_tables].float()  # [R, MB, Hkv, bs, D]
    scores = (q.float()[:, None, :, :, None, :] * k[:, :, :, None, :, :]).sum(-1) * scale  # [R,MB,Hkv,G,bs]
    pos = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, block_size)
    valid = pos[None] < seq_lens[:, None, None]
    if window > 0:
        valid &= pos[None] >= (seq_lens - window)[:, None, None]
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.exp(scores - scores.amax(dim=(1, 4), keepdim=True))
    # Masked slots are zeroed, not just weighted 0: a never-written slot may hold NaN (0 * NaN = NaN).
    v = v_cache[block_tables].float().masked_fill(~valid[:, :, None, :, None], 0.0)  # [R, MB, Hkv, bs, D]
    out = (probs[..., None] * v[:, :, :, None, :, :]).sum(dim=(1, 4))  # [R, Hkv, G, D]
    return (out / probs.sum(dim=(1, 4))[..., None]).to(q.dtype)


@functools.cache
def _compiled_dense_decode() -> Callable[..., torch.Tensor]:
    # A model needs up to four graphs (one or more requests, one or more blocks); every other head
    # layout, window or dtype in the process adds its own.
    return torch.compile(dense_decode, fullgraph=True, dynamic=False, recompile_limit=64)


def _run_compiled_dense(*args: Any) -> torch.Tensor:
    q, k_cache, v_cache, block_tables, seq_lens = args[:5]
    # Requests, cache blocks and table width vary per step: one graph serves them all. Sizes of 1
    # (a single request, a single block) are specialized by Dynamo into graphs of their own.
    for t, dims in ((q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (block_tables, (0, 1)), (seq_lens, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled_dense_decode()(*args)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x.index_select(0, index)` for a contiguous `x`, through a 2-D view: torch's CPU kernel copies
    whole rows with memcpy only for 2-D inputs, and is ~6x slower on the 4-D cache blocks."""
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
    ) -> torch.Tensor:
        if attn_metadata is None:
            return self._prefill(query, key.transpose(0, 1), value.transpose(0, 1), 0).transpose(0, 1)
        md = attn_metadata
        n = md.num_actual_tokens
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise RuntimeError("attention KV cache is not bound (call pagedllm.attention.bind_kv_cache)")
        block_size = kv_cache.shape[3]
        # Whether the native kernel serves this layer, and its head layout for the kernel: once per
        # step for all the layers of this impl (the same graph's tensors, caches allocated alike).
        layout = md.backend_cache.get(self)
        if layout is None:
            layout = self.native_layout(query, key, value, kv_cache)
            md.backend_cache[self] = layout
        native = layout is not False
        plan = _step_plan(md, block_size, self.sliding_window, query.device, native)
        out = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)

        # Write first, so the decode path and cached-prefix chunks read this step's keys too (in a step
        # of decodes only the native kernel's call stores them itself).
        if native:
            if not (isinstance(plan.decode, _NativeDecodePlan) and plan.decode.step.stores_kv):
                cpu_decode.write_kv(key[:n], value[:n], kv_cache, md.slot_mapping[:n])
        else:
            assert plan.slot_block is not None and plan.slot_offset is not None
            # `[num_blocks, block_size, kv_heads, head]` views of the head-major blocks.
            kv_cache[0].transpose(1, 2)[plan.slot_block, plan.slot_offset] = key[:n].to(kv_cache.dtype)
            kv_cache[1].transpose(1, 2)[plan.slot_block, plan.slot_offset] = value[:n].to(kv_cache.dtype)

        prefills = plan.prefills
        if isinstance(layout, cpu_decode.DecodeLayout) and layout.prefill_fn and plan.native_prefill:
            cpu_decode.prefill_layer(query, kv_cache, out, plan.native_prefill, layout)
            prefills = []
        for seg in prefills:
            q = query[seg.start : seg.end]
            if seg.num_computed == 0:
                k, v = key[seg.start : seg.end].transpose(0, 1), value[seg.start : seg.end].transpose(0, 1)
            else:
                nb = (seg.seq_len + block_size - 1) // block_size
                blocks = md.block_tables[seg.req, :nb].long()
                k, v = (self._gather_sequence(kv_cache[i], blocks, seg.seq_len) for i in (0, 1))
            out[seg.start : seg.end] = self._prefill(q, k, v, seg.num_computed).transpose(0, 1)
        if plan.decode is not None:
            self._decode(query, key, value, kv_cache, plan.decode, layout, out)
        return out

    def native_layout(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
    ) -> cpu_decode.DecodeLayout | bool:
        """The kernel's view of this layer, or False where the native kernel cannot serve it."""
        if not cpu_decode.supports(query, key, value, kv_cache, self.num_heads, self.num_kv_heads):
            return False
        return cpu_decode.DecodeLayout(self.num_heads, kv_cache, self.scale, self.sliding_window or 0)

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
        if num_computed > 0 or self.sliding_window is not None:
            q_pos = torch.arange(num_computed, num_computed + q_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(k_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
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

    def _decode(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        p: _DecodePlan | _DenseDecodePlan | _NativeDecodePlan,
        layout: cpu_decode.DecodeLayout | bool,
        out: torch.Tensor,
    ) -> None:
        if isinstance(p, _NativeDecodePlan):
            assert isinstance(layout, cpu_decode.DecodeLayout)
            cpu_decode.decode_layer(query, key, value, kv_cache, out, p.step, layout)
            return
        group = self.num_heads // self.num_kv_heads
        q = query[: p.num_reqs] if p.rows is None else query.index_select(0, p.rows)
        if isinstance(p, _DenseDecodePlan):
            q = q.reshape(p.num_reqs, self.num_kv_heads, group, self.head_size)
            o = _run_compiled_dense(
                q, kv_cache[0], kv_cache[1], p.block_tables, p.seq_lens, self.scale, self.sliding_window or 0
            )
            self._store_decode(o.reshape(p.num_reqs, self.num_heads, self.head_size), p.rows, out)
            return
        q = (q * self.scale).view(p.num_reqs, self.num_kv_heads, group, self.head_size)
        qb = _gather_rows(q.contiguous(), p.req_of_block).to(kv_cache.dtype)  # [B, Hkv, G, D]
        # Head-major blocks: both products below are plain batched GEMMs on the gathered blocks
        # (the key transpose is a BLAS flag), with no layout copies.
        kb = _gather_rows(kv_cache[0], p.block_ids)  # [B, Hkv, bs, D]
        vb = _gather_rows(kv_cache[1], p.block_ids)
        vb.index_copy_(0, p.tail, _gather_rows(vb, p.tail).masked_fill_(~p.tail_valid[:, None, :, None], 0))
        scores = torch.matmul(qb, kb.transpose(-1, -2)).float()  # [B, Hkv, G, bs]
        scores.masked_fill_(~p.valid[:, None, None, :], float("-inf"))
        if p.single_block:
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs.to(vb.dtype), vb)
        else:
            blk_max = scores.amax(dim=-1)
            req_max = torch.full(
                (p.num_reqs, *blk_max.shape[1:]), float("-inf"), dtype=blk_max.dtype, device=blk_max.device
            )
            index = p.req_of_block.view(-1, 1, 1).expand_as(blk_max)
            req_max.scatter_reduce_(0, index, blk_max, "amax")
            probs = torch.exp(scores - req_max.index_select(0, p.req_of_block).unsqueeze(-1))
            denom = _segment_sum(probs.sum(dim=-1), p.req_of_block, p.num_reqs)
            o_blk = torch.matmul(probs.to(vb.dtype), vb).float()  # [B, Hkv, G, D]
            o = _segment_sum(o_blk, p.req_of_block, p.num_reqs) / denom.unsqueeze(-1)
        self._store_decode(o.reshape(p.num_reqs, self.num_heads, self.head_size), p.rows, out)

    @staticmethod
    def _store_decode(o: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor) -> None:
        o = o.to(out.dtype)
        if rows is None:
            out[: o.shape[0]] = o
        else:
            out.index_copy_(0, rows, o)


class TorchPagedAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_PAGED"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchPagedAttentionImpl

    @staticmethod
    def warm_up(device: torch.device) -> None:
        if device.type == "cpu":
            cpu_decode.kernel()  # the first build runs the C compiler (~6 s); later starts load it
