"""What the model runner returns to the scheduler each step (plain Python lists: core/ stays torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsLists:
    """Per sampled token: ids and logprobs of the top-k (index 0 is the sampled token itself)."""

    # [num_tokens][1 + num_logprobs]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    # [num_tokens]: rank of the sampled token in the full vocabulary (1 = most likely).
    sampled_token_ranks: list[int]


def trim_logprobs(lists: LogprobsLists, n: int) -> LogprobsLists:
    """The first ``n`` tokens' entries."""
    return LogprobsLists(lists.token_ids[:n], lists.logprobs[:n], lists.sampled_token_ranks[:n])


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # req_id -> index into the lists below.
    req_id_to_index: dict[str, int]
    # One list per request: empty while the request is still mid-prefill (no token sampled this step).
    sampled_token_ids: list[list[int]]
    # One entry per request (None where no logprobs were asked or no token sampled).
    logprobs: list[LogprobsLists | None] = field(default_factory=list)
    # req_id -> logprobs of the prompt tokens computed this step (for prompt_logprobs requests).
    prompt_logprobs: dict[str, LogprobsLists | None] = field(default_factory=dict)
    # req_id -> pooled output of a pooling request whose prompt was computed this step.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # The KV connector's worker-side counters of the step (bytes_loaded, load_time_s, ...).
    kv_connector_stats: dict[str, float] = field(default_factory=dict)
