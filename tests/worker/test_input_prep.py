"""InputPreparer: a step's flattened inputs from the persistent batch, decodes first, with the slot of
every token in the paged cache and the requests that sample."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.input_prep import InputPreparer
from pagedllm.worker.limits import RunnerLimits

LIMITS = RunnerLimits(block_size=4, max_model_len=32, max_num_reqs=4, max_num_tokens=16)


class KeepCommon:
    """A metadata builder that hands back what the preparer built."""

    def build(self, common: Any) -> Any:
        return common


def test_prepare_puts_decodes_first_and_maps_each_token_to_its_slot() -> None:
    batch = InputBatch(LIMITS.max_num_reqs, LIMITS.max_model_len, LIMITS.max_num_blocks_per_req)
    params = SamplingParams(temperature=0.0)
    # "p": a 10-token prompt in blocks 7, 2, 5, its first chunk of 6 this step (it does not sample).
    batch.add_request(NewRequestData("p", list(range(100, 110)), 10, params, [7, 2, 5], 0))
    # "d": 5 tokens, 4 in the cache (block 3, then block 9): one decode token, which samples.
    batch.add_request(NewRequestData("d", [1, 2, 3, 4, 5], 5, params, [3, 9], 4))
    batch.num_computed_tokens[1] = 4
    so = SchedulerOutput([], CachedRequestData([], [], []), {"p": 6, "d": 1}, 7)
    inputs = InputPreparer(LIMITS, torch.device("cpu"), False, calculate_kv_scales=True)
    step = inputs.prepare(so, batch, None, KeepCommon())  # type: ignore[arg-type]
    assert step.req_ids == ["d", "p"] and step.rows.tolist() == [1, 0]
    assert step.input_ids.tolist() == [5, 100, 101, 102, 103, 104, 105]
    assert step.positions.tolist() == [4, 0, 1, 2, 3, 4, 5]
    md = step.attn_metadata
    # Slot = block id * block size + offset: d's position 4 is block 9's first slot.
    assert md.slot_mapping.tolist() == [36, 28, 29, 30, 31, 8, 9]
    assert md.query_start_loc_cpu == [0, 1, 7] and md.seq_lens_cpu == [5, 6]
    assert md.block_tables.tolist() == [[3, 9], [7, 2]]
    assert step.sample_idx.tolist() == [0]
    # The fp8 scales are computed on the first step with tokens only.
    assert md.calculate_kv_scales
    assert not inputs.prepare(so, batch, None, KeepCommon()).attn_metadata.calculate_kv_scales  # type: ignore[arg-type]
    np.testing.assert_array_equal(step.query_start_loc, [0, 1, 7])
