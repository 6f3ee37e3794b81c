"""The paged PyTorch backend's per-step metadata and its builder.

The builder is made once per set of bound caches: it decides, per distinct impl of the model's
layers, whether the native CPU kernels serve it (its `DecodeLayout`) or tensor ops do. `build()` then
turns each step's common inputs into the plans every layer reads: the decode rows (a request with
up to `MAX_DECODE_QUERY_LEN` new tokens becomes one decode row per token, each with its own length,
over the request's block table: decodes and draft verification alike), the prompt segments, and the
index tensors or kernel argument structures of the paths that run them. Nothing is computed lazily
by the layers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

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

# Requests with at most this many new tokens run as decode rows (each token attends to its own
# prefix, read from the cache where this step's keys were stored first): single-token decodes and
# the 1 + k tokens of a request verifying k drafts. Longer ones are prompt segments, whose kernels
# read each key once for a tile of query rows instead of once per row.
MAX_DECODE_QUERY_LEN = 8

# Decode steps of at most this many rows run the compiled dense kernel when it is enabled: it needs
# no per-block bookkeeping ops, which dominate when there are few rows (figures: benchmarks/RESULTS.md,
# "Figures behind code choices"); with many rows its padding to the longest table costs more than it
# saves.
DENSE_DECODE_MAX_REQS = 8

_COMMON_FIELDS = [f.name for f in fields(CommonAttentionMetadata)]


@dataclass
class DecodeRows:
    """The step's decode rows: per row its query row, its request (block-table row) and its number
    of keys (position + 1), int64 on the host."""

    q_rows: np.ndarray
    reqs: np.ndarray
    seq_lens: np.ndarray


@dataclass
class BlockwiseDecodePlan:
    # Query row of each decode row, or None when they are exactly rows 0..n-1.
    rows: torch.Tensor | None
    num_rows: int
    # Per (decode row, block) entry: the decode row it belongs to, and the cache block id.
    row_of_block: torch.Tensor
    block_ids: torch.Tensor
    # [B, block_size]: which keys of the block the row may attend to.
    valid: torch.Tensor
    # Entries with masked keys (last blocks, sliding-window starts) and their masks: those value
    # rows are zeroed, since a never-written slot may hold NaN and 0 * NaN would poison the sum.
    tail: torch.Tensor
    tail_valid: torch.Tensor
    # True when every row has exactly one block: a plain softmax, no segment reductions.
    single_block: bool


@dataclass
class DenseDecodePlan:
    """A few decode rows for the compiled kernel: query rows, their block-table rows (padded with
    block 0, masked out by `seq_lens`) and their lengths."""

    rows: torch.Tensor | None
    num_rows: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class NativeDecodePlan:
    """Decode rows for the native CPU kernel. In a step without prompts each layer's kernel call
    also stores the step's keys (`step` carries the slots); otherwise they are stored first."""

    step: cpu_decode.DecodeStep


@dataclass
class PrefillSegment:
    req: int
    start: int
    end: int
    num_computed: int
    seq_len: int


@dataclass
class StepPlan:
    decode: BlockwiseDecodePlan | DenseDecodePlan | NativeDecodePlan | None
    prefills: list[PrefillSegment]
    # The prompt segments for the native prompt kernel (native plans only; layouts it does not
    # serve loop over `prefills`).
    native_prefill: cpu_decode.PrefillStep | None
    # Cache block and offset of each new token (from slot_mapping), for the tensor-op write; None in
    # native plans, whose kernels take the slots themselves.
    slot_block: torch.Tensor | None
    slot_offset: torch.Tensor | None


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    # Per impl of the builder's layers: its native kernel layout (None: tensor ops) and its plan.
    layer_plans: dict[AttentionImpl, tuple[cpu_decode.DecodeLayout | None, StepPlan]] = field(
        default_factory=dict, repr=False
    )
    # The native decode kernel's step in a step of decode rows only (each kernel call also stores
    # the step's keys), for a native whole-model decoder; else None.
    native_decode: cpu_decode.DecodeStep | None = field(default=None, repr=False)


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


def tensor_decode_plan(
    common: CommonAttentionMetadata,
    rows: DecodeRows,
    block_size: int,
    window: int | None,
    device: torch.device,
    dense: bool,
) -> BlockwiseDecodePlan | DenseDecodePlan:
    """The tensor-op decode plan of `rows`: dense (the compiled kernel, window applied there) or
    block-wise (one entry per (row, cache block it reads); blocks wholly outside the window are
    skipped, not just masked)."""
    num_rows = int(rows.q_rows.size)
    contiguous = bool(np.array_equal(rows.q_rows, np.arange(num_rows)))
    q_rows = None if contiguous else torch.from_numpy(rows.q_rows).to(device)
    dseq = rows.seq_lens
    reqs = torch.from_numpy(rows.reqs).to(device)
    if dense:
        max_blocks = int((dseq.max() + block_size - 1) // block_size)
        tables = common.block_tables.index_select(0, reqs)[:, :max_blocks].long()
        return DenseDecodePlan(q_rows, num_rows, tables, torch.from_numpy(dseq).to(device))
    first = np.maximum(dseq - window, 0) // block_size if window is not None else np.zeros_like(dseq)
    nblk = (dseq - 1) // block_size - first + 1
    total = int(nblk.sum())
    row_of_block_np = np.repeat(np.arange(num_rows), nblk)
    blk_in_row_np = np.arange(total) - np.repeat(np.cumsum(nblk) - nblk, nblk) + first[row_of_block_np]

    pos = blk_in_row_np[:, None] * block_size + np.arange(block_size)
    seq_of_block = dseq[row_of_block_np][:, None]
    valid_np = pos < seq_of_block
    if window is not None:
        valid_np &= pos >= seq_of_block - window
    tail_np = np.flatnonzero(~valid_np.all(axis=1))

    row_of_block = torch.from_numpy(row_of_block_np).to(device)
    blk_in_row = torch.from_numpy(blk_in_row_np).to(device)
    block_ids = common.block_tables[reqs.index_select(0, row_of_block), blk_in_row].long()
    valid = torch.from_numpy(valid_np).to(device)
    tail = torch.from_numpy(tail_np).to(device)
    return BlockwiseDecodePlan(
        q_rows,
        num_rows,
        row_of_block,
        block_ids,
        valid,
        tail,
        valid.index_select(0, tail),
        bool((nblk == 1).all()),
    )


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
        self.layouts: dict[AttentionImpl, cpu_decode.DecodeLayout | None] = {}
        block_sizes = set()
        for layer in layers:
            cache = layer.kv_cache
            if cache.dim() != 5 or cache.shape[0] != 2:
                raise RuntimeError("attention KV cache is not bound (call pagedllm.attention.bind_kv_cache)")
            block_sizes.add(cache.shape[3])
            if layer.impl not in self.layouts:
                self.layouts[layer.impl] = native_layout_for(layer.impl, cache, dtype)
        if len(block_sizes) != 1:
            raise ValueError(f"the layers' caches need one block size, not {sorted(block_sizes)}")
        (self.block_size,) = block_sizes
        self.native = any(layout is not None for layout in self.layouts.values())
        # The tensor-op decode plan depends on the window (blocks outside it are skipped).
        self.tensor_windows = {impl.sliding_window for impl, layout in self.layouts.items() if layout is None}

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

        native_plan: StepPlan | None = None
        native_decode: cpu_decode.DecodeStep | None = None
        if self.native:
            native_prefill = None
            if prefills:
                segments = [[s.start, s.end - s.start, s.num_computed, s.req] for s in prefills]
                native_prefill = cpu_decode.PrefillStep(
                    common.block_tables, torch.tensor(segments, dtype=torch.int64)
                )
            decode = None
            if rows is not None:
                native_decode = cpu_decode.DecodeStep(
                    common.block_tables,
                    torch.from_numpy(rows.q_rows),
                    torch.from_numpy(rows.reqs),
                    torch.from_numpy(rows.seq_lens),
                    None if prefills else slots,
                )
                decode = NativeDecodePlan(native_decode)
            native_plan = StepPlan(decode, prefills, native_prefill, None, None)
            if prefills:
                native_decode = None

        tensor_plans: dict[int | None, StepPlan] = {}
        if self.tensor_windows:
            slot_block, slot_offset = slots // self.block_size, slots % self.block_size
            dense = self.compiled_decode and rows is not None and rows.q_rows.size <= DENSE_DECODE_MAX_REQS
            for window in self.tensor_windows:
                decode_plan = None
                if rows is not None:
                    decode_plan = tensor_decode_plan(
                        common, rows, self.block_size, window, self.device, dense
                    )
                tensor_plans[window] = StepPlan(decode_plan, prefills, None, slot_block, slot_offset)

        layer_plans: dict[AttentionImpl, tuple[cpu_decode.DecodeLayout | None, StepPlan]] = {}
        for impl, layout in self.layouts.items():
            plan = native_plan if layout is not None else tensor_plans[impl.sliding_window]
            assert plan is not None
            layer_plans[impl] = (layout, plan)
        return TorchPagedMetadata(
            **{name: getattr(common, name) for name in _COMMON_FIELDS},
            layer_plans=layer_plans,
            native_decode=native_decode,
        )
