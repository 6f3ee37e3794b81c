"""The paged attention backend of the CPU (and the portable fallback on CUDA): one forward serves a
flattened batch that mixes decodes, draft verification, whole prompts and prompt chunks whose earlier
tokens are already cached, with no request padded to the longest one.

The step's rows fall into step classes (`protocol.StepClass`: decode rows in steps of few or many
rows, prompt segments), and each class of each layer runs on the backend the composite
(`hybrid.LayerKernels`) chose for it when the builder (`torch_paged_metadata`) was made:

* `cpu_native`: the C kernels (decode rows; bfloat16 prompt segments on AVX512-BF16), on CPU.
* `dense_decode`: a compiled dense kernel for steps of a few decode rows, at O1 and up.
* `portable`: tensor ops for every class, on any device and dtype.

The host-side planning (numpy on the Python lists of lengths) and the prompt loop cannot be traced;
under torch.compile the layer calls this backend through the opaque `pagedllm::unified_attention`
op, so the rest of the model compiles as one graph. The same host work keeps this backend out of
CUDA graph capture: a fused GPU kernel backend is the way there.
"""

from __future__ import annotations

import torch

from pagedllm.attention import fp8_kv
from pagedllm.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadata
from pagedllm.attention.backends import cpu_decode, portable
from pagedllm.attention.backends.cpu_native import native_layout_for
from pagedllm.attention.backends.protocol import LayerCall
from pagedllm.attention.backends.torch_paged_metadata import TorchPagedMetadata, TorchPagedMetadataBuilder


def native_decode_step(
    md: AttentionMetadata, block_size: int | None = None, window: int | None = None
) -> cpu_decode.DecodeStep | None:
    """The native kernel's arguments for a CPU step of decode rows only (each layer's call also
    stores the step's keys), built by the builder; None for a step with prompts or without a native
    plan. The step is the same for every block size and window (the layer's layout carries them):
    `block_size` and `window` are accepted for callers that name the layer they run."""
    return md.native_decode if isinstance(md, TorchPagedMetadata) else None


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
            k, v = key.transpose(0, 1), value.transpose(0, 1)
            return portable.causal_attention(self, query, k, v, 0).transpose(0, 1)
        md = attn_metadata
        entry = md.layer_plans.get(self) if isinstance(md, TorchPagedMetadata) else None
        if entry is None:
            raise RuntimeError(
                "the step's attention metadata was not built for this layer: build it with "
                "TorchPagedMetadataBuilder over the model's attention layers (after bind_kv_cache)"
            )
        state, plan = entry
        n = md.num_actual_tokens
        if kv_scales is None:
            kv_scales = torch.ones(2, device=kv_cache.device)
        if md.calculate_kv_scales and fp8_kv.is_fp8(kv_cache.dtype):
            kv_scales.copy_(fp8_kv.scales_from(key[:n], value[:n], kv_cache.dtype))
        out = torch.zeros_like(query) if query.shape[0] > n else torch.empty_like(query)
        call = LayerCall(self, state, query, key, value, kv_cache, kv_scales, out, n)
        # Store first, so decode rows and cached-prefix chunks read this step's keys too (unless the
        # decode kernel stores them itself, in a step of decode rows only).
        if not plan.decode_stores_kv:
            plan.writer.write_kv(call, plan.store)
        if plan.prefills:
            plan.prompter.prefill(call, md.block_tables, plan.prefills, plan.prompt)
        if plan.decoder is not None:
            plan.decoder.decode(call, plan.decode)
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
