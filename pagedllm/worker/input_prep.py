"""A step's input preparation: the flattened inputs of every scheduled token, built with vectorized numpy
ops into preallocated (pinned, off the CPU) host buffers and copied to the device once.

From the persistent `InputBatch` and the step's `SchedulerOutput` it writes positions, token ids, slot
mapping, query_start_loc, seq_lens and block tables, and hands them to the attention backend's metadata
builder. Composed into `ModelRunner` (pagedllm/worker/model_runner.py), which runs the forward on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, AttentionMetadataBuilder, CommonAttentionMetadata
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.lora.manager import LoRAManager
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.limits import RunnerLimits
from pagedllm.worker.staged_buffer import StagedBuffer


@dataclass
class StepInputs:
    attn_metadata: AttentionMetadata
    input_ids: torch.Tensor
    positions: torch.Tensor
    req_ids: list[str]
    rows: np.ndarray  # InputBatch row of each batch request, in batch order
    query_start_loc: np.ndarray  # [num_reqs + 1] host copy
    # Batch indices of the requests that sample a token this step.
    sample_idx: np.ndarray


class InputPreparer:
    """The step's host buffers and their device copies; `prepare` fills them for one step."""

    def __init__(
        self, limits: RunnerLimits, device: torch.device, pin_memory: bool, calculate_kv_scales: bool
    ) -> None:
        self.max_num_tokens = limits.max_num_tokens
        self.max_num_blocks_per_req = limits.max_num_blocks_per_req
        self.block_size = limits.block_size
        # Whether the next step with tokens sets the layers' fp8 scales (`calculate_kv_scales`).
        self.kv_scales_pending = calculate_kv_scales
        t, r, pin = limits.max_num_tokens, limits.max_num_reqs, pin_memory
        self._input_ids = StagedBuffer(t, torch.int64, device, pin)
        self._positions = StagedBuffer(t, torch.int64, device, pin)
        self._slot_mapping = StagedBuffer(t, torch.int64, device, pin)
        self._query_start_loc = StagedBuffer(r + 1, torch.int32, device, pin)
        self._seq_lens = StagedBuffer(r, torch.int32, device, pin)
        self._num_computed = StagedBuffer(r, torch.int32, device, pin)
        self._block_tables = StagedBuffer((r, self.max_num_blocks_per_req), torch.int32, device, pin)
        # One logits row per scheduled token at most (every token of a request verifying drafts).
        self.logits_indices = StagedBuffer(t, torch.int64, device, pin)
        # Reused index scratch of the flattened batch.
        self.arange = np.arange(max(t, r + 1), dtype=np.int64)
        # Marks the end of a step's host->device input copies: the pinned host buffers are rewritten
        # next step only after it (a step that samples nothing has no other sync point).
        self._inputs_copied = torch.cuda.Event() if device.type == "cuda" else None

    def prepare(
        self,
        so: SchedulerOutput,
        batch: InputBatch,
        lora: LoRAManager | None,
        metadata_builder: AttentionMetadataBuilder,
    ) -> StepInputs:
        total = so.total_num_scheduled_tokens
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens scheduled, more than the step budget of {self.max_num_tokens}")
        if self._inputs_copied is not None:
            self._inputs_copied.synchronize()
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        # Decodes first: the attention backend takes its no-gather fast path when the decode rows are
        # exactly the first rows of the batch.
        is_prefill = num_sched > 1
        # Reorder only when some prefill precedes a decode (the scheduler often sends them sorted).
        if np.any(is_prefill[:-1] & ~is_prefill[1:]):
            order = np.argsort(is_prefill, kind="stable")
            rows, num_sched = rows[order], num_sched[order]
            req_ids = [req_ids[i] for i in order.tolist()]
        num_reqs = len(req_ids)
        if lora is not None:
            lora.set_step(rows, num_sched)

        cu = np.cumsum(num_sched)
        qsl = self._query_start_loc.np[: num_reqs + 1]
        qsl[0] = 0
        qsl[1:] = cu
        computed = batch.num_computed_tokens[rows]
        seq_lens = computed + num_sched

        # Per token: its request's row and its position (computed tokens + offset in this step's run).
        tok_req = np.repeat(rows, num_sched)
        positions = self._positions.np[:total]
        np.subtract(self.arange[:total], np.repeat(cu - num_sched - computed, num_sched), out=positions)
        width = batch.token_ids.shape[1]
        np.take(batch.token_ids.reshape(-1), tok_req * width + positions, out=self._input_ids.np[:total])
        block_idx = tok_req * self.max_num_blocks_per_req + positions // self.block_size
        block_ids = np.take(batch.block_table.reshape(-1), block_idx)
        np.add(block_ids * self.block_size, positions % self.block_size, out=self._slot_mapping.np[:total])

        self._seq_lens.np[:num_reqs] = seq_lens
        self._num_computed.np[:num_reqs] = computed
        np.take(batch.block_table, rows, axis=0, out=self._block_tables.np[:num_reqs])

        # A request samples when its whole sequence is in the cache after this step; otherwise it is
        # mid-prefill (its next chunk comes later).
        sample_idx = np.flatnonzero(seq_lens >= batch.num_tokens[rows])
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        common = CommonAttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            query_start_loc=self._query_start_loc.to_device(num_reqs + 1),
            seq_lens=self._seq_lens.to_device(num_reqs),
            num_computed_tokens=self._num_computed.to_device(num_reqs),
            block_tables=self._block_tables.to_device(num_reqs)[:, :max_blocks],
            slot_mapping=self._slot_mapping.to_device(total),
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=qsl.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            calculate_kv_scales=self.kv_scales_pending,
        )
        self.kv_scales_pending = False
        md = metadata_builder.build(common)
        input_ids = self._input_ids.to_device(total)
        positions_dev = self._positions.to_device(total)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        return StepInputs(
            attn_metadata=md,
            input_ids=input_ids,
            positions=positions_dev,
            req_ids=req_ids,
            rows=rows,
            query_start_loc=qsl.copy(),
            sample_idx=sample_idx,
        )
