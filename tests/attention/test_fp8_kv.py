"""The fp8 KV cache (e4m3, e5m2) in the paged backend: the native kernel's stores equal the tensor
ops' quantization, and every decode path (native kernel, block-wise and compiled tensor ops) attends
the same fp8 cache as a dense reference over the dequantized keys and values does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models.perplexity import smollm2_perplexity
from paged_batch import PagedBatch
from test_torch_paged import _dense_reference

from pagedllm.attention import fp8_kv
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionImpl

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Values past the fp8 maximum once divided by the scale saturate (|v| / 0.004 > 448 for a few).
SCALES = torch.tensor([0.01, 0.004])


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8)
def test_native_store_equals_tensor_quantization(cache_dtype: torch.dtype, act: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(40, 2, 64, generator=gen) * 3).to(act)
    value = (torch.randn(40, 2, 64, generator=gen) * 3).to(act)
    key[0, 0, :4] = torch.tensor([1e-9, 1e-3, -1e5, 0.0])  # a subnormal, a tiny, a saturating value
    slots = torch.randperm(64, generator=gen)[:40]
    native = torch.zeros(2, 4, 2, 16, 64, dtype=cache_dtype)
    cpu_decode.write_kv(key, value, native, slots, SCALES)
    tensor_ops = torch.zeros_like(native)
    for i, x in enumerate((key, value)):
        tensor_ops[i].transpose(1, 2)[slots // 16, slots % 16] = fp8_kv.quantize(x, SCALES[i], cache_dtype)
    assert torch.equal(native.float(), tensor_ops.float())
    assert native.float().abs().max() == fp8_kv.fp8_max(cache_dtype)  # saturated, not inf / NaN


MIXED = [[("a", 37), ("b", 20)], [("b", 30)], [("a", 1), ("b", 1)], [("a", 2), ("b", 1)], [("a", 1)]]
# One request over one kv head: fewer (request, kv head) pairs than twice the threads, so the native
# kernel splits its keys across work items and merges the parts (the value scale applied there).
SPLIT = [[("a", 300)], [("a", 1)]]


@pytest.mark.parametrize("path", ["native", "blockwise", "compiled"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize(("kv_heads", "steps"), [(2, MIXED), (1, SPLIT)], ids=["mixed", "split"])
def test_decode_paths_read_the_fp8_cache(
    kv_heads: int,
    steps: list[list[tuple[str, int]]],
    cache_dtype: torch.dtype,
    act: torch.dtype,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prompts, a chunk over a cached prefix, then decode steps (one with two rows per request):
    each decode row's output equals attention over `dequantize(quantize(k))` of its history."""
    if path != "native":
        monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    monkeypatch.setattr(PagedBatch, "compiled_decode", path == "compiled")
    heads, head_size = 6, 64
    impl = TorchPagedAttentionImpl(heads, head_size, head_size**-0.5, kv_heads, None, None)
    batch = PagedBatch.for_impls([impl], num_blocks=32, dtype=act, cache_dtype=cache_dtype)
    gen = torch.Generator().manual_seed(0)
    history: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for chunks in steps:
        _, md = batch.metadata(chunks)
        assert (md.layer_plans[impl][0] is not None) == (path == "native")
        n = md.num_actual_tokens
        q = torch.randn(n, heads, head_size, generator=gen).to(act)
        k = torch.randn(n, kv_heads, head_size, generator=gen).to(act)
        v = torch.randn(n, kv_heads, head_size, generator=gen).to(act)
        out = impl.forward(q, k, v, batch.kv_caches[0], md, SCALES)
        assert md.query_start_loc_cpu is not None
        for i, (req, num) in enumerate(chunks):
            a, b = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
            stored = [
                fp8_kv.dequantize(fp8_kv.quantize(x[a:b], s, cache_dtype), s, torch.float64)
                for x, s in ((k, SCALES[0]), (v, SCALES[1]))
            ]
            old_k, old_v = history.get(req, (stored[0][:0], stored[1][:0]))
            history[req] = (torch.cat([old_k, stored[0]]), torch.cat([old_v, stored[1]]))
            if num > 2:
                continue  # a prompt: its fresh keys are attended unquantized
            ref = _dense_reference(q[a:b], *history[req], start=old_k.shape[0], scale=impl.scale, window=None)
            atol = 1e-5 if act == torch.float32 else 2e-2
            torch.testing.assert_close(out[a:b].double(), ref, atol=atol, rtol=0)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smollm2_perplexity_with_fp8_cache_within_2_percent(smollm2_gguf: Path) -> None:
    """The embedded SmolLM2 model's perplexity on the fixed text of the GGUF tests with an e4m3
    cache (scales 1.0), fed in 8-token steps so every token's attention reads its keys and values
    from the fp8 cache through the decode kernel, within 2% of the model's own cache dtype."""
    reference = smollm2_perplexity(smollm2_gguf, None, 1024)
    fp8 = smollm2_perplexity(smollm2_gguf, None, 8, cache_dtype=torch.float8_e4m3fn)
    assert abs(fp8 / reference - 1) < 0.02, (fp8, reference)
