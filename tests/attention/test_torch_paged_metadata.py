"""The paged backend's builder: decode rows of multi-token requests, the split between decode rows
and prompt segments, one plan per window for the tensor-op layers, and metadata built once per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_batch import PagedBatch

from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionImpl, native_decode_step
from pagedllm.attention.backends.torch_paged_metadata import (
    BlockwiseDecodePlan,
    NativeDecodePlan,
    decode_rows,
)


def test_decode_rows_of_multi_token_requests() -> None:
    """Request i's token j is a row of num_computed + j + 1 keys over block-table row i."""
    qsl = np.array([0, 1, 4, 6, 26])  # 1, 3, 2 and 20 new tokens
    seq = np.array([10, 7, 2, 50])
    rows = decode_rows(qsl, seq, np.array([0, 1, 2]))
    assert rows is not None
    assert rows.q_rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert rows.reqs.tolist() == [0, 1, 1, 1, 2, 2]
    assert rows.seq_lens.tolist() == [10, 5, 6, 7, 1, 2]
    assert decode_rows(qsl, seq, np.array([], dtype=np.int64)) is None


def test_one_tensor_plan_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-op layers of two windows get plans of their own (blocks outside a window are not
    read); layers sharing a window share one plan."""
    monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    impls = [TorchPagedAttentionImpl(2, 8, 0.3, 1, w) for w in (None, 16)]
    batch = PagedBatch.for_impls(impls, num_blocks=16)
    batch.metadata([("x", 40)])
    _, md = batch.metadata([("x", 1)])
    plans = [md.layer_plans[impl][1].decode for impl in impls]  # type: ignore[attr-defined]
    assert all(isinstance(p, BlockwiseDecodePlan) for p in plans)
    assert [p.block_ids.shape[0] for p in plans] == [3, 2]  # 41 keys; the last 16 span 2 blocks


def test_native_step_for_a_decode_only_step() -> None:
    """A step of decode rows only has the native kernel's step (storing the keys) for a native
    whole-model decoder; a step with a prompt has none."""
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=16)
    _, md = batch.metadata([("x", 30)])
    assert native_decode_step(md, 16, None) is None
    _, md = batch.metadata([("x", 1)])
    step = native_decode_step(md, 16, None)
    layout, plan = md.layer_plans[impl]  # type: ignore[attr-defined]
    assert layout is not None and isinstance(plan.decode, NativeDecodePlan)
    assert step is plan.decode.step and step.stores_kv


def test_layers_do_not_write_the_metadata() -> None:
    """Everything a layer reads is built in build(): running the layers leaves the metadata as it was."""
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=16)
    _, md = batch.metadata([("x", 30), ("y", 3)])
    before = dict(vars(md))
    q, kv = torch.randn(33, 4, 16), torch.randn(33, 2, 16)
    impl.forward(q, kv, kv, batch.kv_caches[0], md)
    assert vars(md) == before and not hasattr(md, "backend_cache")
