"""The attention layer models call: `attn(q, k, v)`, with the paged cache bound by the runner."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionImpl, AttentionParams
from pagedllm.attention.selector import get_attn_backend
from pagedllm.forward_context import get_forward_context

# The impl of every attention layer constructed in this process, by its parameters. The op below
# resolves a layer's impl here. It is keyed by the parameters, not by the layer: `CompiledForward`
# traces ONE decoder block and runs that graph for every layer, so whatever the op takes as a
# constant is baked from the traced layer; a layer index or name would make every layer use the
# first one's impl (guards are skipped) or, with guards, force one graph per layer (N x the compile
# time). Layers with equal parameters compute the same thing and share an impl; layers that differ
# (a sliding-window layer beside a global one, another soft cap) get different graph keys
# (`AttentionGraphKey`: a block's impls' `params`) and resolve different impls here.
# The per-layer state (the cache) stays a tensor argument, the per-step state (the metadata) comes
# from the forward context.
_IMPLS: dict[AttentionParams, AttentionImpl] = {}


def _register_impl(params: AttentionParams) -> AttentionImpl:
    impl = _IMPLS.get(params)
    if impl is None:
        impl = _IMPLS[params] = get_attn_backend().get_impl_cls()(
            params.num_heads,
            params.head_size,
            params.scale,
            params.num_kv_heads,
            params.sliding_window or None,
            params.logits_soft_cap or None,
        )
    return impl


def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int,
    sliding_window: int,
    logits_soft_cap: float,
) -> torch.Tensor:
    """One layer's attention as an opaque op for torch.compile (`torch.ops.pagedllm.unified_attention`):
    the backend's per-layer work stays out of the traced graph (no graph break), and the metadata
    is read from the forward context at run time. The constants are the layer's `AttentionParams`
    (window 0 and soft cap 0.0 for none), by which it finds the impl its layer registered.

    The layer's cache (and its fp8 scales) are tensor arguments, not a name: one traced decoder block
    serves every layer, each call passing its own cache. The op writes this step's keys and values into `kv_cache` as a
    side effect, deliberately undeclared: declaring it would make the functionalized graph copy the
    whole cache, and nothing else in a graph reads the cache.

    Registered through `torch.library.Library` rather than `torch.library.custom_op`, whose Python
    wrapper runs argument and aliasing checks on every call, per layer and step (figures:
    benchmarks/RESULTS.md, "Figures behind code choices")."""
    # A plain tuple finds the `AttentionParams` key (equal and hashed alike) without its constructor.
    impl = _IMPLS[(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap)]  # type: ignore[index]
    return impl.forward(query, key, value, kv_cache, get_forward_context().attn_metadata, kv_scales)


def _unified_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_scales: torch.Tensor,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int,
    sliding_window: int,
    logits_soft_cap: float,
) -> torch.Tensor:
    return torch.empty_like(query)


_LIBRARY = torch.library.Library("pagedllm", "DEF")
_LIBRARY.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, Tensor kv_cache, Tensor kv_scales, int num_heads, "
    "int head_size, float scale, int num_kv_heads, int sliding_window, float logits_soft_cap) -> Tensor"
)
_LIBRARY.impl("unified_attention", unified_attention, "CompositeExplicitAutograd")
torch.library.register_fake("pagedllm::unified_attention", _unified_attention_fake, lib=_LIBRARY)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    `kv_cache` is a plain attribute (not a buffer: it is neither a weight nor saved), shaped
    `backend.get_kv_cache_shape(...)` (see `pagedllm.attention.backend`); empty until `bind_kv_cache`.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        sliding_window: int | None = None,
        prefix: str = "",
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.layer_name = prefix
        self.backend = get_attn_backend()
        # Registered for the compiled path's op, which resolves it by the same parameters.
        self.impl = _register_impl(
            AttentionParams(
                num_heads, head_size, scale, self.num_kv_heads, sliding_window or 0, logits_soft_cap or 0.0
            )
        )
        self.kv_cache = torch.empty(0)
        # [k_scale, v_scale] of an fp8 cache (`pagedllm.attention.fp8_kv`); unused by other dtypes.
        self.kv_scales = torch.ones(2, dtype=torch.float32)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`query` [T, num_heads * head_size], `key`/`value` [T, num_kv_heads * head_size] ->
        [T, num_heads * head_size]."""
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        if torch.compiler.is_compiling():
            out = torch.ops.pagedllm.unified_attention(
                q, k, v, self.kv_cache, self.kv_scales, *self.impl.params
            )
        else:
            # Eager: call the backend directly, skipping the op dispatcher's overhead.
            out = self.impl.forward(
                q, k, v, self.kv_cache, get_forward_context().attn_metadata, self.kv_scales
            )
        return out.reshape(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        params = self.impl.params
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"sliding_window={params.sliding_window}, logits_soft_cap={params.logits_soft_cap}"
        )


class AttentionGraphKey:
    """Attention's part of a compiled block's key (`pagedllm.layers.graph_key`): the params of the
    block's layers, which the traced op takes as constants. The impls and backend are opaque to the
    trace (the op resolves the impl by its params at run time)."""

    def owns(self, obj: object) -> bool:
        return isinstance(obj, AttentionImpl) or (isinstance(obj, type) and issubclass(obj, AttentionBackend))

    def graph_key(self, block: nn.Module) -> Hashable:
        return tuple(m.impl.params for m in block.modules() if isinstance(m, Attention))

    def step_graph_key(self) -> Hashable:
        return None


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every `Attention` module of `model` by qualified name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


def bind_kv_cache(model: nn.Module, kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> None:
    """Give each attention layer its cache tensor: a list in layer order, or a dict keyed by the
    layer's qualified module name (e.g. "model.layers.0.self_attn.attn")."""
    layers = attention_layers(model)
    if isinstance(kv_caches, Mapping):
        missing = sorted(set(layers) - set(kv_caches))
        extra = sorted(set(kv_caches) - set(layers))
        if missing or extra:
            raise ValueError(
                f"KV caches do not match the attention layers: missing {missing}, unknown {extra}"
            )
        for name, layer in layers.items():
            layer.kv_cache = kv_caches[name]
        return
    if len(kv_caches) != len(layers):
        raise ValueError(f"got {len(kv_caches)} KV cache tensors for {len(layers)} attention layers")
    for layer, cache in zip(layers.values(), kv_caches):
        layer.kv_cache = cache
