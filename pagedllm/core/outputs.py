"""What the engine core produces each step: per-request outputs, finish reasons and scheduler counters.

msgspec structs so the same types cross the ZMQ socket of the server unchanged. They live in core/
because the scheduler builds them; `pagedllm.engine.protocol` re-exports them for the front-end.
"""

from __future__ import annotations

import enum
import time

import msgspec

from pagedllm.core.runner_output import LogprobsLists
from pagedllm.errors import ErrorReport


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the client or at shutdown

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    # The stop token id (int) that ended the request, if any.
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Of num_cached_tokens, those a KV connector supplied (vllm:prompt_tokens_by_source).
    num_external_computed_tokens: int = 0
    # When the scheduler first scheduled the request (queue time = this - arrival_time). Wall clock
    # (time.time()), like the front-end's arrival_time: time.monotonic()'s reference point is undefined,
    # so it is only comparable within one process. Sent once, with the request's first output.
    first_scheduled_time: float | None = None
    # A pooling request's output (embedding, class probabilities or score), sent with its finish.
    pooling_output: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Prompt tokens looked up in / supplied by a KV connector (offloading tier, shared storage).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # The connector's transfer counters (bytes_loaded, bytes_saved, load_time_s, save_time_s).
    kv_connector_stats: dict[str, float] = {}
    # LoRA adapter name -> its running / waiting requests (LoRA enabled only).
    running_lora_adapters: dict[str, int] = {}
    waiting_lora_adapters: dict[str, int] = {}
    # Speculative decoding since the last stats: requests that verified drafts, drafted tokens, accepted
    # tokens, and accepted tokens by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    # Wall clock, like every time that crosses the process boundary.
    timestamp: float = msgspec.field(default_factory=time.time)
    # Requests the core finished on its own initiative (e.g. rejected at admission): id -> message.
    errors: dict[str, ErrorReport] = {}
    # The data parallel rank of the core that sent these (parallel_config.data_parallel_index).
    engine_index: int = 0
