"""The linear layers' sharding: each parameter's `weight_loader` takes its shard (q/k/v, gate/up) and
this rank's slice of it, at simulated tensor-parallel ranks (parallel_state monkeypatched), and the
ranks' partial products add up to the unsharded layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed import parallel_state
from pagedllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)


def _at_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: size)


def _heads(w: torch.Tensor, head_size: int, first: int, count: int) -> torch.Tensor:
    return w[first * head_size : (first + count) * head_size]


@pytest.mark.parametrize(
    ("size", "kv_heads", "rank"),
    # tp=2 with 2 kv heads: one kv head each; tp=4 with 2 kv heads: each kv head on two ranks.
    [(1, 2, 0), (2, 2, 0), (2, 2, 1), (4, 2, 0), (4, 2, 1), (4, 2, 2), (4, 2, 3)],
)
def test_qkv_shards_by_shard_id_and_rank(
    monkeypatch: pytest.MonkeyPatch, size: int, kv_heads: int, rank: int
) -> None:
    _at_rank(monkeypatch, rank, size)
    heads, head_size, hidden = 4, 3, 8
    q = torch.randn(heads * head_size, hidden)
    k, v = torch.randn(kv_heads * head_size, hidden), torch.randn(kv_heads * head_size, hidden)
    qb, kb, vb = (
        torch.randn(heads * head_size),
        torch.randn(kv_heads * head_size),
        torch.randn(kv_heads * head_size),
    )
    layer = QKVParallelLinear(hidden, head_size, heads, kv_heads, bias=True)
    for shard, w, b in (("v", v, vb), ("q", q, qb), ("k", k, kb)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    my_heads = heads // size
    my_kv_heads = max(1, kv_heads // size)
    kv_head = rank * kv_heads // size  # the kv head(s) this rank holds
    want_w = torch.cat(
        [
            _heads(q, head_size, rank * my_heads, my_heads),
            _heads(k, head_size, kv_head, my_kv_heads),
            _heads(v, head_size, kv_head, my_kv_heads),
        ]
    )
    want_b = torch.cat(
        [
            _heads(qb[:, None], head_size, rank * my_heads, my_heads)[:, 0],
            _heads(kb[:, None], head_size, kv_head, my_kv_heads)[:, 0],
            _heads(vb[:, None], head_size, kv_head, my_kv_heads)[:, 0],
        ]
    )
    assert (layer.num_heads, layer.num_kv_heads) == (my_heads, my_kv_heads)
    torch.testing.assert_close(layer.weight.data, want_w, atol=0, rtol=0)
    torch.testing.assert_close(layer.bias.data, want_b, atol=0, rtol=0)
    # A checkpoint with q, k and v already fused loads to the same slices.
    fused = QKVParallelLinear(hidden, head_size, heads, kv_heads)
    fused.weight.weight_loader(fused.weight, torch.cat([q, k, v]))
    torch.testing.assert_close(fused.weight.data, want_w, atol=0, rtol=0)


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (0, 2), (1, 2)])
def test_merged_column_shards_by_index_and_rank(
    monkeypatch: pytest.MonkeyPatch, rank: int, size: int
) -> None:
    _at_rank(monkeypatch, rank, size)
    gate, up = torch.randn(12, 5), torch.randn(12, 5)
    layer = MergedColumnParallelLinear(5, [12, 12])
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    n = 12 // size
    want = torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]])
    torch.testing.assert_close(layer.weight.data, want, atol=0, rtol=0)
    fused = MergedColumnParallelLinear(5, [12, 12])
    fused.weight.weight_loader(fused.weight, torch.cat([gate, up]))
    torch.testing.assert_close(fused.weight.data, want, atol=0, rtol=0)
    # The rank's output is its slice of each projection's output.
    x = torch.randn(3, 5)
    got = layer(x)
    torch.testing.assert_close(got, torch.cat([F.linear(x, want[:n]), F.linear(x, want[n:])], -1))
    with pytest.raises(ValueError, match="unknown shard id 2"):
        layer.weight.weight_loader(layer.weight, gate, 2)


def test_column_and_row_ranks_add_up_to_the_whole_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column-parallel then row-parallel (an MLP's shape) over two simulated ranks: the sum of the
    ranks' outputs (the all-reduce) is the unsharded result, the row layer's bias added once."""
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(8, 6), torch.randn(8), torch.randn(6, 8), torch.randn(6)
    x = torch.randn(4, 6)
    monkeypatch.setattr(parallel_state, "tensor_model_parallel_all_reduce", lambda t: t)
    total = torch.zeros(4, 6)
    for rank in range(2):
        _at_rank(monkeypatch, rank, 2)
        up, down = ColumnParallelLinear(6, 8, bias=True), RowParallelLinear(8, 6, bias=True)
        for layer, w, b in ((up, w1, b1), (down, w2, b2)):
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
        assert up.weight.shape == (4, 6) and down.weight.shape == (6, 4) and down.bias.shape == (6,)
        total += down(up(x))
    torch.testing.assert_close(total, F.linear(F.linear(x, w1, b1), w2, b2))


def test_shape_mismatches_are_value_errors() -> None:
    qkv = QKVParallelLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match="does not match"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(9, 16), "k")
    with pytest.raises(ValueError, match="unknown QKV shard id"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(8, 16), "x")
    with pytest.raises(ValueError, match="does not have 32 rows"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(31, 16))
    row = RowParallelLinear(8, 6)
    with pytest.raises(ValueError, match="does not match"):
        row.weight.weight_loader(row.weight, torch.randn(6, 9))
    with pytest.raises(ValueError, match="has no shard"):
        row.weight.weight_loader(row.weight, torch.randn(6, 8), 0)


def test_sizes_not_divisible_by_the_tp_size_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _at_rank(monkeypatch, 0, 3)
    with pytest.raises(ValueError, match=r"number of attention heads \(4\) is not divisible"):
        QKVParallelLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match=r"input size \(8\) is not divisible"):
        RowParallelLinear(8, 6, prefix="down")


def test_parameters_in_the_default_dtype_and_unquantized_product() -> None:
    """Weights are created in the default dtype (the loader sets the model's), and the unquantized
    product is `F.linear`."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ColumnParallelLinear(4, 3, bias=True)
    finally:
        torch.set_default_dtype(previous)
    assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert layer.quant_method.dense_weight(layer) is layer.weight
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=0, rtol=0)
