"""SchedulerConfig: batch limits and scheduling policy."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pagedllm.config.utils import config, hash_fields

RunnerType = Literal["generate", "pooling", "draft"]
SchedulerPolicy = Literal["fcfs", "priority"]


@config
class SchedulerConfig:
    """Configuration of the continuous-batching scheduler."""

    runner_type: RunnerType = "generate"
    """What the model runner does: generate text, pool hidden states, or draft tokens."""
    max_num_batched_tokens: Annotated[int, Field(gt=0)] | None = None
    """Token budget of one engine step (prefill chunks and decodes together). Unset: the platform
    default (CPU 4096, CUDA 8192), at least `max_model_len` when chunked prefill is off."""
    max_num_seqs: Annotated[int, Field(gt=0)] | None = None
    """Maximum number of sequences in one step. Unset: 256."""
    max_model_len: Annotated[int, Field(gt=0)] | None = None
    """Maximum sequence length (prompt plus output); copied from the model config when unset."""
    max_num_partial_prefills: Annotated[int, Field(ge=1)] = 1
    """Maximum number of prompts partially prefilled at the same time."""
    max_long_partial_prefills: Annotated[int, Field(ge=1)] = 1
    """Of those, how many may be longer than `long_prefill_token_threshold`."""
    long_prefill_token_threshold: Annotated[int, Field(ge=0)] = 0
    """A prompt longer than this counts as long; one step schedules at most this many of its tokens
    (0: no limit beyond the step budget)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep running beside them."""
    policy: SchedulerPolicy = "fcfs"
    """Order of admission: first come first served, or by request priority (lower first) then arrival."""
    disable_chunked_mm_input: bool = False
    """Never split one multimodal input item across steps."""
    scheduler_cls: str | None = None
    """Fully qualified class name of a custom scheduler."""
    disable_hybrid_kv_cache_manager: bool | None = None
    """Use one KV cache group for all layers even for hybrid models; unset lets the engine decide."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N executes; unset lets the engine decide."""
    max_num_scheduled_tokens: Annotated[int, Field(ge=0)] | None = None
    """Tokens the scheduler may schedule per step when speculative decoding needs extra slots."""
    scheduler_reserve_full_isl: bool = False
    """Admit a request only when KV blocks for its whole prompt are free."""
    stream_interval: Annotated[int, Field(ge=1)] = 1
    """Send streamed outputs every this many tokens (always the first token and the last): fewer, larger
    messages to stream clients; the text is the same."""

    def __post_init__(self) -> None:
        from pagedllm.platforms import current_platform

        if self.max_num_seqs is None:
            self.max_num_seqs = current_platform.default_max_num_seqs()
        # Remember whether the budget is a default: only a default may grow to fit max_model_len later.
        self.max_num_batched_tokens_defaulted = self.max_num_batched_tokens is None
        if self.max_num_batched_tokens is None:
            budget = current_platform.default_max_num_batched_tokens()
            if not self.enable_chunked_prefill and self.max_model_len is not None:
                # Without chunking a whole prompt must fit in one step.
                budget = max(budget, self.max_model_len)
            self.max_num_batched_tokens = budget
        self.verify()

    @property
    def step_token_budget(self) -> int:
        """The most tokens one step runs: the scheduler's budget, and what the runner's buffers hold.
        `max_num_batched_tokens`, or a smaller `max_num_scheduled_tokens` (speculative decoding may set
        one to keep slots for drafts); a larger one is capped."""
        assert self.max_num_batched_tokens is not None
        return min(self.max_num_scheduled_tokens or self.max_num_batched_tokens, self.max_num_batched_tokens)

    def verify(self) -> None:
        """Cross-field checks; run again by EngineConfig after `max_model_len` is known."""
        assert self.max_num_batched_tokens is not None and self.max_num_seqs is not None
        if self.max_model_len is not None and not self.enable_chunked_prefill:
            if self.max_num_batched_tokens < self.max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({self.max_model_len}) with enable_chunked_prefill=False: a long prompt could never be "
                    "scheduled; raise max_num_batched_tokens or enable chunked prefill"
                )
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )

    def compute_hash(self) -> str:
        # The scheduler's limits do not change the traced forward; capture sizes are hashed with the
        # compilation config. Hashing nothing here keeps the cache valid across budget changes.
        return hash_fields(self, ())
