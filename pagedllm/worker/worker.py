"""A worker: one device, one model runner. Executors drive workers (calling its methods by name through
`Executor.collective_rpc`); the runner does the work."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.platforms import current_platform
from pagedllm.worker.kv_cache import KVCacheSpec
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm.worker")


class Worker:
    def __init__(self, engine_config: Any, rank: int = 0, local_rank: int = 0) -> None:
        self.engine_config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.model_runner: ModelRunner | None = None

    def init_device(self) -> None:
        device = torch.device(self.engine_config.device_config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device if device.index is not None else self.local_rank)
        elif current_platform.is_cpu():
            if not envs.is_set("OMP_NUM_THREADS"):
                # torch defaults to the physical core count of the whole machine, which oversubscribes
                # a container or a process pinned to fewer cores; an explicit OMP_NUM_THREADS wins.
                torch.set_num_threads(current_platform.get_cpu_count())
            current_platform.tune_allocator()
        seed = self.engine_config.model_config.seed
        if seed is not None:
            # Unseeded random requests draw from the default generators: seeding them makes a run
            # reproducible as a whole (seeded requests have their own generators).
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)
        self.model_runner = ModelRunner(self.engine_config)

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("Worker.init_device() must be called first")
        return self.model_runner

    def load_model(self) -> None:
        self.runner.load_model()

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.runner.get_kv_cache_spec()

    def determine_available_kv_cache_bytes(self) -> int:
        return self.runner.determine_available_kv_cache_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self.runner.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.runner.sample_tokens(grammar_output)

    def propose_draft_token_ids(self) -> dict[str, list[int]] | None:
        return self.runner.propose_draft_token_ids()

    def shutdown(self) -> None:
        # Drop the model and caches so their memory is returned now, not at interpreter exit.
        self.model_runner = None
        if current_platform.is_cuda():
            torch.cuda.empty_cache()
