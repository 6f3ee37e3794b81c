"""The native CPU backend: the C kernels bound in `cpu_decode` (kernels/cpu/attention_decode.c,
attention_prefill.c), which read each request's blocks where they lie (no gathered copy).

* Decode rows, in float32 or bfloat16 over a cache of that dtype or of fp8: one kernel call for all
  rows. In a step of decode rows only each layer's call also stores the step's keys and values;
  otherwise `write_kv` stores them first.
* Prompt segments in bfloat16 on an AVX512-BF16 CPU (`cpu_decode.prompt_kernel_serves`): one call
  for all segments, reading keys from the paged cache (stored first).

The per-layer constants are the layer's `DecodeLayout` (its window and soft cap included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.attention.backend import AttentionImpl, CommonAttentionMetadata
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.protocol import (
    AttentionFeatures,
    DecodeRows,
    LayerCall,
    PrefillSegment,
    StepClass,
)


@dataclass
class NativeDecodePlan:
    """Decode rows for the native CPU kernel. In a step without prompts each layer's kernel call
    also stores the step's keys (`step` carries the slots); otherwise they are stored first."""

    step: cpu_decode.DecodeStep


def native_layout_for(
    impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype
) -> cpu_decode.DecodeLayout | None:
    """The native kernels' view of a layer of `impl` with activations of `dtype` over `kv_cache`,
    or None where they cannot serve it. The kernels apply its window and soft cap themselves."""
    if not cpu_decode.supports(dtype, kv_cache, impl.num_heads, impl.num_kv_heads):
        return None
    return cpu_decode.DecodeLayout(
        impl.num_heads, kv_cache, impl.scale, impl.sliding_window or 0, impl.logits_soft_cap or 0.0, dtype
    )


def _check_dtype(rows: torch.Tensor, layout: cpu_decode.DecodeLayout) -> None:
    if rows.dtype != layout.dtype:
        raise TypeError(f"{rows.dtype} activations over a {layout.dtype} cache reached the native kernel")


class NativeCpuAttention:
    """Decode rows and (bfloat16) prompt segments through the C kernels."""

    name = "cpu-native"
    plans_per_window = False

    def unsupported(self, features: AttentionFeatures, step: StepClass) -> str | None:
        f = features
        if not cpu_decode.supports(f.dtype, f.kv_cache, f.num_heads, f.num_kv_heads):
            return (
                "the C kernels take float32 or bfloat16 activations over a contiguous CPU cache of that "
                f"dtype or fp8, at most {cpu_decode.MAX_GROUP} query heads per KV head, a head size of at "
                f"most {cpu_decode.MAX_HEAD} in whole {cpu_decode.LANES}-lane vectors, and a built kernel "
                f"library (here: {f.dtype} over a {f.cache_dtype} {f.device_type} cache, "
                f"{f.num_heads // f.num_kv_heads} heads per KV head, head size {f.head_size})"
            )
        group = f.num_heads // f.num_kv_heads
        if step is StepClass.PROMPTS and not cpu_decode.prompt_kernel_serves(
            f.head_size, group, f.block_size, f.cache_dtype
        ):
            return (
                "the prompt kernel takes a bfloat16 cache on an AVX512-BF16 CPU, head sizes in whole "
                f"32-element pairs, blocks of whole 16-key chunks and at most {cpu_decode.PREFILL_TILE} "
                "heads per KV head"
            )
        return None

    def layer_state(
        self, impl: AttentionImpl, kv_cache: torch.Tensor, dtype: torch.dtype
    ) -> cpu_decode.DecodeLayout | None:
        return native_layout_for(impl, kv_cache, dtype)

    def plan_decode(
        self, common: CommonAttentionMetadata, rows: DecodeRows, window: int, block_size: int, mixed: bool
    ) -> NativeDecodePlan:
        slots = None if mixed else common.slot_mapping[: common.num_actual_tokens]
        step = cpu_decode.DecodeStep(
            common.block_tables,
            torch.from_numpy(rows.q_rows),
            torch.from_numpy(rows.reqs),
            torch.from_numpy(rows.seq_lens),
            slots,
        )
        return NativeDecodePlan(step)

    def stores_kv(self, plan: NativeDecodePlan) -> bool:
        return plan.step.stores_kv

    def plan_store(self, slots: torch.Tensor, block_size: int) -> torch.Tensor:
        return slots

    def write_kv(self, call: LayerCall, plan: torch.Tensor) -> None:
        n = call.num_tokens
        _check_dtype(call.key, call.state)
        cpu_decode.write_kv(call.key[:n], call.value[:n], call.kv_cache, plan, call.kv_scales)

    def decode(self, call: LayerCall, plan: NativeDecodePlan) -> None:
        c = call
        _check_dtype(c.query, c.state)
        cpu_decode.decode_layer(c.query, c.key, c.value, c.kv_cache, c.kv_scales, c.out, plan.step, c.state)

    def plan_prompts(
        self, common: CommonAttentionMetadata, prefills: list[PrefillSegment]
    ) -> cpu_decode.PrefillStep:
        segments = [[s.start, s.end - s.start, s.num_computed, s.req] for s in prefills]
        return cpu_decode.PrefillStep(common.block_tables, torch.tensor(segments, dtype=torch.int64))

    def prefill(
        self, call: LayerCall, block_tables: torch.Tensor, prefills: list[PrefillSegment], plan: Any
    ) -> None:
        _check_dtype(call.query, call.state)
        cpu_decode.prefill_layer(call.query, call.kv_cache, call.out, plan, call.state)


NATIVE = NativeCpuAttention()
