"""The runner's fixed sizes, read once from the engine configuration: what its buffers, its KV cache
sizing and its profiling forward are built for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


@dataclass(frozen=True)
class RunnerLimits:
    block_size: int
    max_model_len: int
    # Requests and tokens of one step (the step's token budget: `SchedulerConfig.step_token_budget`).
    max_num_reqs: int
    max_num_tokens: int

    @classmethod
    def of(cls, engine_config: EngineConfig) -> RunnerLimits:
        sc = engine_config.scheduler_config
        assert sc.max_num_seqs is not None  # resolved when the config is built
        return cls(
            block_size=engine_config.cache_config.block_size,
            max_model_len=engine_config.model_config.max_model_len,
            max_num_reqs=sc.max_num_seqs,
            max_num_tokens=sc.step_token_budget,
        )

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)
