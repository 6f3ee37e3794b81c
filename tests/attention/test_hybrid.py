"""The composite's choice of backend per step class: given a layer's features, which backend runs
each class and why the preferred ones were passed over; a layer no backend serves is an error."""

from __future__ import annotations

import pytest
import torch
from paged_batch import BoundImpl, PagedBatch

from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.hybrid import DECODE_PREFERENCE, LayerKernels, choose
from pagedllm.attention.backends.protocol import AttentionFeatures, StepClass, UnsupportedAttention
from pagedllm.attention.backends.torch_paged import TorchPagedAttentionImpl
from pagedllm.attention.backends.torch_paged_metadata import TorchPagedMetadataBuilder


def _features(
    dtype: torch.dtype = torch.bfloat16,
    cache_dtype: torch.dtype | None = None,
    compiled: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    head_size: int = 64,
) -> AttentionFeatures:
    impl = TorchPagedAttentionImpl(heads, head_size, head_size**-0.5, kv_heads)
    cache = torch.zeros(2, 4, kv_heads, 16, head_size, dtype=cache_dtype or dtype)
    return AttentionFeatures.of_layer(impl, cache, dtype, compiled)


def _names(features: AttentionFeatures) -> dict[StepClass, str]:
    return {c.step: c.name for c in LayerKernels.of(features).choices}


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
def test_the_c_kernels_serve_decodes_of_their_dtypes(cache_dtype: torch.dtype | None) -> None:
    assert cpu_decode.kernel() is not None, "the native kernels did not build"
    for compiled in (False, True):
        names = _names(_features(torch.bfloat16, cache_dtype, compiled))
        assert names[StepClass.FEW_DECODES] == names[StepClass.DECODES] == "cpu-native"


def test_the_prompt_kernel_serves_bf16_prompts_where_the_cpu_has_it() -> None:
    kernels = LayerKernels.of(_features(torch.bfloat16))
    prompts = kernels.choices[2]
    if cpu_decode.kernel().prefill_supported():
        assert prompts.name == "cpu-native" and not prompts.passed_over
    else:
        assert prompts.name == "portable" and "AVX512-BF16" in prompts.describe()
    # An fp8 cache's prompts run on tensor ops (the prompt kernel reads bfloat16 caches only).
    fp8 = LayerKernels.of(_features(torch.bfloat16, torch.float8_e4m3fn)).choices[2]
    assert fp8.name == "portable" and fp8.passed_over[0][0] == "cpu-native"


def test_without_the_c_kernels_few_decodes_take_the_compiled_dense_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of at most 8 decode rows run the dense kernel beside compiled graphs only; longer
    decode steps and prompts run on tensor ops; each choice names the backends passed over."""
    monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    compiled = LayerKernels.of(_features(torch.float32, compiled=True))
    assert [c.name for c in compiled.choices] == ["compiled-dense", "portable", "portable"]
    assert compiled.decode_for(8).name == "compiled-dense" and compiled.decode_for(9).name == "portable"
    eager = LayerKernels.of(_features(torch.float32, compiled=False))
    assert [c.name for c in eager.choices] == ["portable", "portable", "portable"]
    few = eager.choices[0]
    assert [name for name, _ in few.passed_over] == ["cpu-native", "compiled-dense"]
    assert "not compiled-dense: the forward is not compiled" in few.describe()


def test_float16_layers_pass_over_the_c_kernels() -> None:
    choices = LayerKernels.of(_features(torch.float16)).choices
    assert [c.name for c in choices] == ["portable"] * 3
    assert "torch.float16" in choices[1].passed_over[0][1]


def test_a_cache_dtype_no_backend_stores_is_an_error() -> None:
    """An int8 cache is one no backend can store (tensor ops would truncate keys to integers): the
    choice fails naming every backend's reason, and so does building the step metadata for it."""
    features = _features(torch.float32, torch.int8)
    with pytest.raises(UnsupportedAttention, match=r"cpu-native: .*portable: a torch.int8 KV cache"):
        choose(features, StepClass.DECODES, DECODE_PREFERENCE[StepClass.DECODES])
    impl = TorchPagedAttentionImpl(2, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=4)
    layer = BoundImpl(impl, batch.kv_caches[0].to(torch.int8))
    with pytest.raises(UnsupportedAttention, match="no attention backend serves the decode"):
        TorchPagedMetadataBuilder([layer], torch.float32, torch.device("cpu"))


def test_the_builder_names_each_step_class_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_decode, "supports", lambda *args: False)
    impl = TorchPagedAttentionImpl(2, 16, 0.25, 2)
    batch = PagedBatch.for_impls([impl], num_blocks=4)
    layer = BoundImpl(impl, batch.kv_caches[0])
    builder = TorchPagedMetadataBuilder([layer], torch.float32, torch.device("cpu"), compiled_decode=True)
    assert builder.backend_names() == {
        StepClass.FEW_DECODES.value: ["compiled-dense"],
        StepClass.DECODES.value: ["portable"],
        StepClass.PROMPTS.value: ["portable"],
    }
