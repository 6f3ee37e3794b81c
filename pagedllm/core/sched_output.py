"""What the scheduler hands the model runner each step.

Delta-encoded as in vLLM V1: a request's prompt and sampling parameters travel once (in
``scheduled_new_reqs``); afterwards only its newly allocated blocks and its progress travel (in
``scheduled_cached_reqs``). A request resumed after preemption is sent again as a new request carrying
all of its tokens so far, because the runner dropped its state at preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    # Prompt tokens followed by any output tokens generated before a preemption.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    # Set for a pooling request: the runner returns its pooled output instead of sampling.
    pooling_params: PoolingParams | None = None


@dataclass
class CachedRequestData:
    """Parallel lists, one entry per running request that the runner already knows."""

    req_ids: list[str] = field(default_factory=list)
    # Blocks appended to the request's block table this step (possibly empty).
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    # Each request's input tokens this step, sent only while several batches are in flight (pipeline
    # parallelism): only the output rank samples, and the other ranks learn the tokens here.
    token_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> number of tokens to run this step (prefill chunk length, or 1 for a decode).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished or were preempted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens scheduled for verification after the request's last token (their count is
    # included in num_scheduled_tokens). Only requests with drafts appear.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # What the KV connector's worker side loads and saves this step (None without a connector).
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """The step's structured-output constraints: for each constrained request (in this order), its row
    of ``grammar_bitmask`` [num_constrained, ceil(vocab / 32)] int32 (bit set = token allowed)."""

    structured_output_request_ids: list[str]
    grammar_bitmask: Any
