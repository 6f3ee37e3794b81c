"""The paged backend's per-step metadata and its builder.

The builder is made once per set of bound caches: it asks the composite (`hybrid.LayerKernels`)
which backend runs each step class of each distinct impl of the model's layers, and keeps the
per-layer constants of the one that stores its keys and values (the native kernels' `DecodeLayout`,
or None). `build()` then turns each step's common inputs into the plans every layer reads: the decode
rows (a request with up to `MAX_DECODE_QUERY_LEN` new tokens becomes one decode row per token, each
with its own length, over the request's block table: decodes and draft verification alike), the
prompt segments, and each chosen backend's plan of them, built once for every layer it serves.
Nothing is computed lazily by the layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from pagedllm.attention.backend import (
    AttentionImpl,
    AttentionLayer,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from pagedllm.attention.backends import cpu_decode
from pagedllm.attention.backends.cpu_native import NATIVE, NativeDecodePlan
from pagedllm.attention.backends.dense_decode import DenseDecodePlan
from pagedllm.attention.backends.hybrid import LayerKernels
from pagedllm.attention.backends.portable import BlockwiseDecodePlan
from pagedllm.attention.backends.protocol import (
    MAX_DECODE_QUERY_LEN,
    AttentionFeatures,
    DecodeKernels,
    DecodeRows,
    PrefillSegment,
    PromptKernels,
)

logger = logging.getLogger("pagedllm.attention")

_COMMON_FIELDS = [f.name for f in fields(CommonAttentionMetadata)]


@dataclass
class StepPlan:
    """One kind of layer's work in a step: the backend of each of its step classes and their plans
    (shared by every layer of the same choices and, where the decode plan depends on it, window)."""

    decode: BlockwiseDecodePlan | DenseDecodePlan | NativeDecodePlan | None
    prefills: list[PrefillSegment]
    # The prompt backend's plan of `prefills` (None without prompt segments, or where it needs none).
    prompt: Any
    # The writer's plan of this step's slots.
    store: Any
    decoder: DecodeKernels | None
    prompter: PromptKernels
    writer: DecodeKernels
    # The decode kernel stores the step's keys and values itself (the writer is not called).
    decode_stores_kv: bool


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    # Per impl of the builder's layers: its writer's per-layer constants (the native kernels'
    # `DecodeLayout`, or None for tensor ops) and its plan.
    layer_plans: dict[AttentionImpl, tuple[cpu_decode.DecodeLayout | None, StepPlan]] = field(
        default_factory=dict, repr=False
    )
    # The native decode kernel's step in a step of decode rows only (each kernel call also stores
    # the step's keys), for a native whole-model decoder; else None.
    native_decode: cpu_decode.DecodeStep | None = field(default=None, repr=False)


def decode_rows(qsl: np.ndarray, seq: np.ndarray, reqs: np.ndarray) -> DecodeRows | None:
    """The decode rows of requests `reqs` (indices into the step's `qsl` [num_reqs + 1] and `seq`
    [num_reqs]): token j of request i is a row of seq[i] - q_len[i] + j + 1 keys."""
    if reqs.size == 0:
        return None
    q_lens = qsl[reqs + 1] - qsl[reqs]
    if bool((q_lens == 1).all()):
        return DecodeRows(qsl[reqs], reqs, seq[reqs])
    row_req = np.repeat(reqs, q_lens)
    offset = np.arange(row_req.size) - np.repeat(np.cumsum(q_lens) - q_lens, q_lens)
    first = np.repeat(seq[reqs] - q_lens, q_lens)
    return DecodeRows(qsl[row_req] + offset, row_req, first + offset + 1)


class TorchPagedMetadataBuilder(AttentionMetadataBuilder):
    """Builds `TorchPagedMetadata` for the given layers (see the module docstring)."""

    def __init__(
        self,
        layers: Iterable[AttentionLayer],
        dtype: torch.dtype,
        device: torch.device,
        compiled_decode: bool = False,
    ) -> None:
        super().__init__(layers, dtype, device, compiled_decode)
        self.layers: dict[AttentionImpl, tuple[Any, LayerKernels]] = {}
        block_sizes = set()
        for layer in layers:
            cache = layer.kv_cache
            if cache.dim() != 5 or cache.shape[0] != 2:
                raise RuntimeError("attention KV cache is not bound (call pagedllm.attention.bind_kv_cache)")
            block_sizes.add(cache.shape[3])
            if layer.impl not in self.layers:
                features = AttentionFeatures.of_layer(layer.impl, cache, dtype, compiled_decode)
                kernels = LayerKernels.of(features)
                self.layers[layer.impl] = (kernels.writer.layer_state(layer.impl, cache, dtype), kernels)
                logger.debug(
                    "attention backends of %s: %s",
                    layer.impl.params,
                    "; ".join(choice.describe() for choice in kernels.choices),
                )
        if len(block_sizes) != 1:
            raise ValueError(f"the layers' caches need one block size, not {sorted(block_sizes)}")
        (self.block_size,) = block_sizes

    def backend_names(self) -> dict[str, list[str]]:
        """The backends each step class runs on across the layers, by the class's name."""
        names: dict[str, list[str]] = {}
        for _, kernels in self.layers.values():
            for step, name in kernels.names().items():
                if name not in names.setdefault(step, []):
                    names[step].append(name)
        return names

    def build(self, common: CommonAttentionMetadata) -> TorchPagedMetadata:
        n = common.num_actual_tokens
        qsl = np.asarray(
            common.query_start_loc_cpu
            if common.query_start_loc_cpu is not None
            else common.query_start_loc.tolist(),
            dtype=np.int64,
        )[: common.num_reqs + 1]
        seq = np.asarray(
            common.seq_lens_cpu if common.seq_lens_cpu is not None else common.seq_lens.tolist(),
            dtype=np.int64,
        )[: common.num_reqs]
        q_lens = np.diff(qsl)
        short = q_lens <= MAX_DECODE_QUERY_LEN
        prefills = [
            PrefillSegment(int(i), int(qsl[i]), int(qsl[i + 1]), int(seq[i] - q_lens[i]), int(seq[i]))
            for i in np.flatnonzero(~short)
        ]
        rows = decode_rows(qsl, seq, np.flatnonzero(short))
        slots = common.slot_mapping[:n]
        mixed = bool(prefills)

        # Each backend's plans are built once per step (per window where they depend on it) and
        # shared by the layers it serves.
        decode_plans: dict[tuple[str, int], Any] = {}
        prompt_plans: dict[str, Any] = {}
        store_plans: dict[str, Any] = {}
        step_plans: dict[tuple[str, int, str, str], StepPlan] = {}
        layer_plans: dict[AttentionImpl, tuple[Any, StepPlan]] = {}
        for impl, (state, kernels) in self.layers.items():
            decoder = kernels.decode_for(int(rows.q_rows.size)) if rows is not None else None
            window = impl.params.sliding_window if decoder is not None and decoder.plans_per_window else 0
            key = (decoder.name if decoder else "", window, kernels.prompts.name, kernels.writer.name)
            plan = step_plans.get(key)
            if plan is None:
                decode_plan = None
                if decoder is not None and rows is not None:
                    decode_plan = decode_plans.get((decoder.name, window))
                    if decode_plan is None:
                        decode_plan = decoder.plan_decode(common, rows, window, self.block_size, mixed)
                        decode_plans[(decoder.name, window)] = decode_plan
                prompt_plan = None
                if prefills and kernels.prompts.name not in prompt_plans:
                    prompt_plans[kernels.prompts.name] = kernels.prompts.plan_prompts(common, prefills)
                if prefills:
                    prompt_plan = prompt_plans[kernels.prompts.name]
                writer = kernels.writer
                if writer.name not in store_plans:
                    store_plans[writer.name] = writer.plan_store(slots, self.block_size)
                stores = decoder is not None and decoder.stores_kv(decode_plan)
                plan = step_plans[key] = StepPlan(
                    decode_plan,
                    prefills,
                    prompt_plan,
                    store_plans[writer.name],
                    decoder,
                    kernels.prompts,
                    writer,
                    stores,
                )
            layer_plans[impl] = (state, plan)
        native = decode_plans.get((NATIVE.name, 0))
        return TorchPagedMetadata(
            **{name: getattr(common, name) for name in _COMMON_FIELDS},
            layer_plans=layer_plans,
            native_decode=native.step if native is not None and not mixed else None,
        )
