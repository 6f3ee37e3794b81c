"""The paged PyTorch backend vs a dense reference, on random mixed batches: decodes, draft
verification rows, fresh prompts, prompt chunks over cached prefixes, GQA, sliding windows, logit
soft caps (per layer), bfloat16, padded token rows."""

from __future__ import annotations

import pytest
import torch
from paged_batch import PagedBatch
from torch import nn

from pagedllm.attention import Attention, bind_kv_cache
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionImpl
from pagedllm.attention.backends.torch_paged_metadata import (
    MAX_DECODE_QUERY_LEN,
    BlockwiseDecodePlan,
    NativeDecodePlan,
    TorchPagedMetadataBuilder,
)


@pytest.fixture(autouse=True, params=["native", "blockwise", "compiled"], ids=lambda p: f"{p}-decode")
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with decode steps on each path: the native CPU kernel (the default on CPU
    for float32/bfloat16), and the tensor-op paths used where it cannot run: block-wise, and the
    compiled dense kernel the runner enables at O1 and up for steps of up to 8 decoding requests."""
    if request.param == "native":
        assert cpu_decode.kernel() is not None, "the native decode kernel did not build"
    else:
        monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    monkeypatch.setattr(PagedBatch, "compiled_decode", request.param == "compiled")
    return request.param


def _dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int | None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """q [L, H, D] at positions start.., k/v [S, Hkv, D] at 0..S-1 -> [L, H, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hls,shd->lhd", probs, v)


def _run_steps(
    steps: list[list[tuple[str, int]]],
    heads: int,
    kv_heads: int,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    pad: int = 0,
    block_size: int = 16,
    head_size: int = 16,
    layers: list[tuple[int | None, float | None]] | None = None,
) -> list[TorchPagedAttentionImpl]:
    """Runs `steps` through one layer per (window, soft cap) of `layers` (default: one layer of
    `window`, no cap), all on each step's one metadata, each checked against the dense reference.
    Returns the layers' impls."""
    scale = head_size**-0.5
    impls = [
        TorchPagedAttentionImpl(heads, head_size, scale, kv_heads, w, cap)
        for w, cap in layers or [(window, None)]
    ]
    batch = PagedBatch.for_impls(
        impls,
        num_blocks=96 * 16 // block_size + 8,
        block_size=block_size,
        dtype=dtype,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(0)
    history: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for chunks in steps:
        _, md = batch.metadata(chunks)
        n = md.num_actual_tokens
        for layer, impl in enumerate(impls):
            q = torch.randn(n + pad, heads, head_size, generator=gen).to(dtype)
            k = torch.randn(n + pad, kv_heads, head_size, generator=gen).to(dtype)
            v = torch.randn(n + pad, kv_heads, head_size, generator=gen).to(dtype)
            out = impl.forward(q, k, v, batch.kv_caches[layer], md)
            assert out.shape == q.shape and out.dtype == dtype
            assert md.query_start_loc_cpu is not None
            for i, (req, _) in enumerate(chunks):
                a, b = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
                old_k, old_v = history.get((layer, req), (k[:0], v[:0]))
                history[layer, req] = (torch.cat([old_k, k[a:b]]), torch.cat([old_v, v[a:b]]))
                ref = _dense_reference(
                    q[a:b],
                    *history[layer, req],
                    start=old_k.shape[0],
                    scale=scale,
                    window=impl.sliding_window,
                    soft_cap=impl.logits_soft_cap,
                )
                torch.testing.assert_close(out[a:b].double(), ref, atol=atol, rtol=0)
            if pad:
                assert torch.all(out[n:] == 0)
    return impls


MIXED_STEPS = [
    [("a", 20), ("b", 1), ("c", 37)],
    [("a", 1), ("b", 1), ("c", 12), ("d", 50)],  # decodes, a chunk with a prefix, a fresh prompt
    [("d", 1), ("a", 1), ("e", 2), ("c", 1), ("b", 30)],
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],  # pure decode
    [("e", 17), ("a", 1)],
]
# Draft verification: requests with 2..5 new tokens (each attending to the cache and the earlier new
# tokens) beside single-token decodes and prompts, and steps of decode rows only.
SPEC_STEPS = [
    [("p", 40), ("q", 1), ("r", 23)],
    [("p", 3), ("q", 1), ("r", 5), ("s", 2)],
    [("r", 4), ("s", 45), ("p", 1), ("q", 2)],
    [("p", 5), ("q", 3), ("r", 1), ("s", 4)],
    [("s", 2), ("p", 18), ("q", 5)],
]


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_mixed_batches_match_dense(heads: int, kv_heads: int) -> None:
    _run_steps(MIXED_STEPS, heads, kv_heads)


def test_sliding_window() -> None:
    _run_steps(MIXED_STEPS + [[("d", 1), ("c", 1)]] * 3, 4, 2, window=21)


def test_bfloat16_cache() -> None:
    _run_steps(MIXED_STEPS, 4, 2, dtype=torch.bfloat16)


def test_padded_rows_are_zero() -> None:
    _run_steps(MIXED_STEPS, 4, 2, pad=5)


@pytest.mark.parametrize("block_size", [4, 32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes(block_size: int, dtype: torch.dtype) -> None:
    """Blocks of fewer, and of more, keys than the native kernel takes at once (16), the window's
    first key inside one of them."""
    _run_steps(MIXED_STEPS + [[("d", 1), ("c", 1)]] * 3, 4, 2, window=21, dtype=dtype, block_size=block_size)


def test_native_kernel_calls_per_step(decode_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of decodes only stores its keys inside the layer's single kernel call; a step with
    prompts stores them first (its cached-prefix chunks read them), then attends its decodes."""
    if decode_path != "native":
        pytest.skip("the native path's calls")
    calls: list[str] = []
    for name in ("write_kv", "decode_layer"):
        original = getattr(cpu_decode, name)
        monkeypatch.setattr(cpu_decode, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    steps = MIXED_STEPS + SPEC_STEPS
    _run_steps(steps, 4, 2)
    expected = []
    for chunks in steps:
        has_prompt = any(n > MAX_DECODE_QUERY_LEN for _, n in chunks)
        has_decode = any(n <= MAX_DECODE_QUERY_LEN for _, n in chunks)
        expected += ["write_kv"] * has_prompt + ["decode_layer"] * has_decode
    assert calls == expected


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "window", "soft_cap"),
    [
        (9, 3, 64, None, None),
        (4, 4, 128, None, None),
        (7, 1, 32, 21, None),
        (8, 2, 64, 40, None),
        (8, 2, 64, 40, 0.7),
    ],
    ids=["smollm2", "mha-128", "mqa-32-window", "gqa-window", "gqa-window-softcap"],
)
def test_native_prompt_kernel(
    heads: int,
    kv_heads: int,
    head_size: int,
    window: int | None,
    soft_cap: float | None,
    block_size: int,
    decode_path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bfloat16 prompts with head sizes in multiples of 32 run the native prompt kernel, one call
    per step for all segments: fresh prompts, chunks over cached prefixes (query tiles and 16-key
    chunks cut at odd places), windows, soft caps, beside the cache's never-written (NaN) slots."""
    if decode_path != "native":
        pytest.skip("the native path")
    lib = cpu_decode.kernel()
    if lib is None or not lib.prefill_supported():
        pytest.skip("the prompt kernel needs AVX512-BF16, which this CPU lacks")
    calls: list[int] = []
    original = cpu_decode.prefill_layer
    monkeypatch.setattr(
        cpu_decode, "prefill_layer", lambda *a: (calls.append(a[3].segments.shape[0]), original(*a))[1]
    )
    steps = [*MIXED_STEPS, [("f", 150), ("a", 1)], [("f", 70), ("g", 33)], [("f", 1), ("g", 1)]]
    _run_steps(
        steps,
        heads,
        kv_heads,
        dtype=torch.bfloat16,
        block_size=block_size,
        head_size=head_size,
        layers=[(window, soft_cap)],
    )
    prompts = [sum(n > MAX_DECODE_QUERY_LEN for _, n in chunks) for chunks in steps]
    assert calls == [count for count in prompts if count]


def test_many_decodes_one_step() -> None:
    # 40 requests of assorted lengths prefilled, then decoded together (block-segment softmax).
    lengths = [1 + (7 * i) % 60 for i in range(40)]
    _run_steps([[(str(i), n) for i, n in enumerate(lengths)], [(str(i), 1) for i in range(40)]], 4, 2)


@pytest.mark.parametrize("window", [None, 40])
def test_decode_work_is_linear_in_keys_attended(window: int | None, decode_path: str) -> None:
    """The block-wise decode path's batch has one entry per (request, cache block it reads): the
    total is the sum of each request's own block count (fewer with a window), not num_requests x the
    longest request's blocks, so short requests beside a long one cost only their own keys. (The
    native kernel walks each request's own blocks by construction.)"""
    if decode_path != "blockwise":
        pytest.skip("the block-wise path's plan")
    lengths = [1, 16, 17, 500, 3]
    impl = TorchPagedAttentionImpl(2, 8, 0.3, 2, window)
    batch = PagedBatch.for_impls([impl], num_blocks=64, block_size=16)
    batch.metadata([(str(i), n - 1) for i, n in enumerate(lengths) if n > 1])
    _, md = batch.metadata([(str(i), 1) for i in range(len(lengths))])
    _, plan = md.layer_plans[impl]  # type: ignore[attr-defined]
    assert isinstance(plan.decode, BlockwiseDecodePlan) and not plan.prefills

    def blocks_read(n: int) -> int:
        first = 0 if window is None else max(n - window, 0) // 16
        return (n - 1) // 16 - first + 1

    assert plan.decode.block_ids.shape[0] == sum(blocks_read(n) for n in lengths)
    # Keys a request may see: exactly its sequence (or window), so no padding is attended.
    per_req = torch.zeros(len(lengths), dtype=torch.long).index_add_(
        0, plan.decode.row_of_block, plan.decode.valid.sum(1)
    )
    assert per_req.tolist() == [n if window is None else min(n, window) for n in lengths]


def test_new_keys_written_at_slot_mapping() -> None:
    impl = TorchPagedAttentionImpl(2, 8, 0.3, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=8, block_size=4)
    _, md = batch.metadata([("x", 6)])
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    impl.forward(torch.randn(6, 2, 8), k, v, batch.kv_caches[0], md)
    cache = batch.kv_caches[0]
    blocks = batch.blocks["x"]
    for pos in range(6):
        assert torch.equal(cache[0, blocks[pos // 4], :, pos % 4], k[pos])
        assert torch.equal(cache[1, blocks[pos // 4], :, pos % 4], v[pos])


def test_no_metadata_is_one_causal_sequence_without_cache() -> None:
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    out = impl.forward(q, k, v, torch.empty(0), None)
    torch.testing.assert_close(out.double(), _dense_reference(q, k, v, 0, 0.25, None), atol=1e-5, rtol=0)


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Attention(2, 8, 0.3, 1, prefix="first")
        self.second = Attention(2, 8, 0.3, 1, prefix="second")


def test_bind_kv_cache_by_list_and_name() -> None:
    model = _TwoLayers()
    a, b = torch.zeros(2, 4, 1, 16, 8), torch.zeros(2, 4, 1, 16, 8)
    bind_kv_cache(model, [a, b])
    assert model.first.kv_cache is a and model.second.kv_cache is b
    bind_kv_cache(model, {"first": b, "second": a})
    assert model.first.kv_cache is b and model.second.kv_cache is a
    with pytest.raises(ValueError, match="1 KV cache tensors for 2 attention layers"):
        bind_kv_cache(model, [a])
    with pytest.raises(ValueError, match=r"missing \['second'\]"):
        bind_kv_cache(model, {"first": a})


def test_unbound_cache_is_a_clear_error() -> None:
    layer = Attention(2, 8, 0.3, 1)
    with pytest.raises(RuntimeError, match="not bound"):
        TorchPagedMetadataBuilder([layer], torch.float32, torch.device("cpu"))


def test_metadata_of_other_layers_is_a_clear_error() -> None:
    """A layer whose impl the builder was not given finds no plan: an error, not a lazy build."""
    impl = TorchPagedAttentionImpl(2, 8, 0.3, 1)
    batch = PagedBatch.for_impls([impl], num_blocks=8)
    _, md = batch.metadata([("x", 3)])
    other = TorchPagedAttentionImpl(2, 8, 0.3, 1, 4)
    with pytest.raises(RuntimeError, match="not built for this layer"):
        other.forward(
            torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8), batch.kv_caches[0], md
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_kernel_serves_cpu_decodes_of_its_dtypes(dtype: torch.dtype, decode_path: str) -> None:
    if decode_path != "native":
        pytest.skip("the choice of the native path")
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=8, block_size=16, dtype=dtype)
    batch.metadata([("x", 5)])
    _, md = batch.metadata([("x", 1)])
    q, kv = torch.randn(1, 4, 16).to(dtype), torch.randn(1, 2, 16).to(dtype)
    impl.forward(q, kv, kv, batch.kv_caches[0], md)
    layout, plan = md.layer_plans[impl]  # type: ignore[attr-defined]
    # float16 has no native kernel on CPU: the tensor-op path serves it.
    assert isinstance(plan.decode, NativeDecodePlan) == (layout is not None) == (dtype != torch.float16)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(
    ("lengths", "kv_heads"),
    [([700, 3, 257, 16, 17, 130], 3), ([700], 3), ([1100, 9], 1)],
    ids=["batch", "one-long", "mqa-few"],
)
def test_long_decodes_at_model_shapes(
    window: int | None, lengths: list[int], kv_heads: int, block_size: int
) -> None:
    """SmolLM2's attention shape (9 heads over 3 kv heads of 64), long and short requests decoding
    together, in bfloat16: many blocks and softmax segments per request, the online softmax across
    them. With fewer (request, kv head) pairs than twice the threads, the native kernel splits each
    request's keys across threads and merges the parts ("one-long", "mqa-few"), also with blocks of
    128 (vLLM's CPU default), where a split must still keep whole blocks."""
    heads, head_size = 9, 64
    impl = TorchPagedAttentionImpl(heads, head_size, head_size**-0.5, kv_heads, window)
    batch = PagedBatch.for_impls([impl], num_blocks=128, block_size=block_size, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    keys, values = {}, {}
    for step in (
        [(str(i), n - 1) for i, n in enumerate(lengths)],
        [(str(i), 1) for i in range(len(lengths))],
    ):
        _, md = batch.metadata(step)
        n = md.num_actual_tokens
        q = torch.randn(n, heads, head_size, generator=gen).bfloat16()
        k = torch.randn(n, kv_heads, head_size, generator=gen).bfloat16()
        v = torch.randn(n, kv_heads, head_size, generator=gen).bfloat16()
        out = impl.forward(q, k, v, batch.kv_caches[0], md)
        assert md.query_start_loc_cpu is not None
        for i, (req, _) in enumerate(step):
            a, b = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            keys[req] = torch.cat([keys.get(req, k[:0]), k[a:b]])
            values[req] = torch.cat([values.get(req, v[:0]), v[a:b]])
        for i, (req, _) in enumerate(step if step[0][1] == 1 else []):
            ref = _dense_reference(
                q[i : i + 1], keys[req], values[req], lengths[i] - 1, head_size**-0.5, window
            )
            torch.testing.assert_close(out[i : i + 1].double(), ref, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (6, 1)], ids=["gqa", "mqa"])
def test_draft_verification_rows_match_dense(
    heads: int, kv_heads: int, block_size: int, dtype: torch.dtype
) -> None:
    """Requests with 2..5 new tokens beside single-token decodes and prompts: every new token
    attends causally to the cache and the request's earlier new tokens."""
    _run_steps(SPEC_STEPS, heads, kv_heads, dtype=dtype, block_size=block_size)


def test_draft_verification_runs_as_decode_rows(decode_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of requests with up to MAX_DECODE_QUERY_LEN new tokens has no prompt segment: its
    tokens are decode rows of one kernel call (native) or one block-wise batch (tensor ops), not a
    per-request loop."""
    if decode_path == "compiled":
        pytest.skip("the native and block-wise plans")
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=32)
    batch.metadata([("a", 20), ("b", 9), ("c", 30)])
    _, md = batch.metadata([("a", 3), ("b", 1), ("c", MAX_DECODE_QUERY_LEN)])
    layout, plan = md.layer_plans[impl]  # type: ignore[attr-defined]
    assert not plan.prefills
    rows = 3 + 1 + MAX_DECODE_QUERY_LEN
    if decode_path == "native":
        assert layout is not None and isinstance(plan.decode, NativeDecodePlan)
        assert plan.decode.step.stores_kv and plan.decode.step.args.num_reqs == rows
    else:
        assert isinstance(plan.decode, BlockwiseDecodePlan) and plan.decode.num_rows == rows
    # One more new token makes it a prompt segment.
    _, md = batch.metadata([("a", MAX_DECODE_QUERY_LEN + 1), ("b", 1)])
    _, plan = md.layer_plans[impl]  # type: ignore[attr-defined]
    assert [(s.req, s.end - s.start) for s in plan.prefills] == [(0, MAX_DECODE_QUERY_LEN + 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_per_layer_windows_and_soft_caps(block_size: int, dtype: torch.dtype) -> None:
    """Layers with different sliding windows and logit soft caps (small caps, so the tanh bends
    most scores) on one step's metadata, every path applying each layer's own."""
    layers = [(None, None), (21, None), (None, 0.7), (13, 2.0)]
    _run_steps(MIXED_STEPS + SPEC_STEPS, 4, 2, dtype=dtype, block_size=block_size, layers=layers)


def test_soft_cap_without_metadata() -> None:
    """The profiling path (no cache) applies the soft cap too."""
    impl = TorchPagedAttentionImpl(4, 16, 0.25, 2, logits_soft_cap=0.5)
    q, k, v = torch.randn(9, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    out = impl.forward(q, k, v, torch.empty(0), None)
    ref = _dense_reference(q, k, v, 0, 0.25, None, soft_cap=0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


class _CappedBlock(nn.Module):
    """Two attention layers that differ only in window and soft cap."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = Attention(4, 16, 0.25, 2, prefix="plain")
        self.capped = Attention(4, 16, 0.25, 2, sliding_window=5, prefix="capped", logits_soft_cap=0.5)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.plain(q, k, v) + self.capped(q, k, v)


def test_compiled_op_resolves_each_layers_impl() -> None:
    """Through torch.compile each layer's op call finds its own impl (window and soft cap), so the
    traced block gives the eager result."""
    from pagedllm.forward_context import set_forward_context

    block = _CappedBlock()
    assert block.plain.impl is not block.capped.impl
    assert block.capped.impl.params.logits_soft_cap == 0.5 and block.capped.impl.sliding_window == 5
    batch = PagedBatch.for_model(block, num_blocks=16)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    for chunks in ([("x", 12), ("y", 3)], [("x", 2), ("y", 1)]):
        _, md = batch.metadata(chunks)
        n = md.num_actual_tokens
        q, k, v = torch.randn(n, 64), torch.randn(n, 32), torch.randn(n, 32)
        with torch.no_grad(), set_forward_context(md):
            # Eager first: it stores the step's keys, which the compiled call then stores again.
            eager = block(q, k, v)
            traced = compiled(q, k, v)
        torch.testing.assert_close(traced, eager)
