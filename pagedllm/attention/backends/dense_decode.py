"""The compiled dense decode backend: a few decode rows' attention as plain tensor ops compiled by
Inductor, which fuses the block gathers into its loads (no gathered copy of the keys or values is
materialized and no per-block bookkeeping ops run). It serves only steps of class FEW_DECODES of a
compiled forward (O1 and up); it stores keys and values as the portable backend does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.backend import AttentionImpl, CommonAttentionMetadata
from pagedllm.attention.backends import portable
from pagedllm.attention.backends.protocol import AttentionFeatures, DecodeRows, LayerCall, StepClass


@dataclass
class DenseDecodePlan:
    """A few decode rows for the compiled kernel: query rows, their block-table rows (padded with
    block 0, masked out by `seq_lens`) and their lengths."""

    rows: torch.Tensor | None
    num_rows: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


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


class CompiledDenseDecode:
    """Decode rows of FEW_DECODES steps through the compiled `dense_decode`."""

    name = "compiled-dense"
    plans_per_window = False

    def unsupported(self, features: AttentionFeatures, step: StepClass) -> str | None:
        if step is not StepClass.FEW_DECODES:
            return f"serves only {StepClass.FEW_DECODES.value}"
        if not features.compiled:
            return "the forward is not compiled (O0): the dense kernel runs only beside compiled graphs"
        return portable.tensor_ops_unsupported(features)

    def layer_state(self, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        return None

    def plan_decode(
        self, common: CommonAttentionMetadata, rows: DecodeRows, window: int, block_size: int, mixed: bool
    ) -> DenseDecodePlan:
        device = common.block_tables.device
        reqs = torch.from_numpy(rows.reqs).to(device)
        max_blocks = int((rows.seq_lens.max() + block_size - 1) // block_size)
        tables = common.block_tables.index_select(0, reqs)[:, :max_blocks].long()
        seq_lens = torch.from_numpy(rows.seq_lens).to(device)
        return DenseDecodePlan(portable.query_rows(rows, device), int(rows.q_rows.size), tables, seq_lens)

    def stores_kv(self, plan: Any) -> bool:
        return False

    def plan_store(self, slots: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return portable.store_slots(slots, block_size)

    def write_kv(self, call: LayerCall, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        portable.write_kv_tensors(call, plan)

    def decode(self, call: LayerCall, plan: DenseDecodePlan) -> None:
        impl, query, kv_cache = call.impl, call.query, call.kv_cache
        p, group = plan, impl.num_heads // impl.num_kv_heads
        q = query[: p.num_rows] if p.rows is None else query.index_select(0, p.rows)
        q = q.reshape(p.num_rows, impl.num_kv_heads, group, impl.head_size)
        params = impl.params
        kind = (params, kv_cache.dtype, kv_cache.shape[3])
        o = _run_compiled_dense(
            kind,
            q,
            kv_cache[0],
            kv_cache[1],
            call.kv_scales,
            p.block_tables,
            p.seq_lens,
            impl.scale,
            params.sliding_window,
            params.logits_soft_cap,
        )
        portable.store_decode(o.reshape(p.num_rows, impl.num_heads, impl.head_size), p.rows, call.out)


COMPILED_DENSE = CompiledDenseDecode()
