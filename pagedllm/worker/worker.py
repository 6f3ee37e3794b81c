"""A worker: one device, one model runner. Executors drive workers (calling its methods by name through
`Executor.collective_rpc`); the runner does the work."""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm import envs
from pagedllm.core.runner_output import ModelRunnerOutput
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.distributed import parallel_state
from pagedllm.kv_cache_interface import KVCacheSpec
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.tracing import flush_traces, step_span
from pagedllm.platforms import current_platform
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.profiler import TorchProfiler
from pagedllm.worker.sleep import WorkerSleep
from pagedllm.worker.weight_update import WeightUpdater

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

logger = logging.getLogger("pagedllm.worker")


class Worker:
    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        """`distributed_init_method` (a torch init URL: `file://` on one machine, `tcp://host:port` or
        `env://` across machines): where the ranks of a multi-worker executor meet to form their process
        groups; None for the one-worker executor. `cpu_threads`: torch's thread count on a CPU, when the
        executor decided it (see `init_device`)."""
        self.engine_config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.cpu_threads = cpu_threads
        self.model_runner: ModelRunner | None = None
        self._sleep: WorkerSleep | None = None
        self._weight_updater: WeightUpdater | None = None
        profiler_config = engine_config.profiler_config
        pc = engine_config.parallel_config
        dp_rank = pc.data_parallel_index if pc.data_parallel_size > 1 else None
        self.profiler = (
            TorchProfiler(profiler_config.torch_profiler_dir, engine_config.instance_id, rank, dp_rank)
            if profiler_config.profiler == "torch"
            else None
        )
        # collect_detailed_traces "worker": a span per step's forward and per sampling.
        observability = engine_config.observability_config
        self._execute_span = step_span(observability, "worker", "execute_model")
        self._sample_span = step_span(observability, "worker", "sample_tokens")

    def init_device(self) -> None:
        device = torch.device(self.engine_config.device_config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device if device.index is not None else self.local_rank)
        elif current_platform.is_cpu():
            if self.cpu_threads is not None:
                # The Ray executor's choice: Ray sets OMP_NUM_THREADS in its actors (to their one
                # logical CPU), so the actor's environment does not say what the user asked for.
                torch.set_num_threads(self.cpu_threads)
            elif not envs.is_set("OMP_NUM_THREADS"):
                # torch defaults to the physical core count of the whole machine, which oversubscribes
                # a container or a process pinned to fewer cores; an explicit OMP_NUM_THREADS wins.
                # Ranks started on this machine by one executor share its cores.
                ranks_here = 1 if self.distributed_init_method is None else self.engine_config.parallel_config.world_size
                torch.set_num_threads(max(1, current_platform.get_cpu_count() // ranks_here))
            current_platform.tune_allocator()
            current_platform.bound_kernel_caches()
        if self.distributed_init_method is not None:
            pc = self.engine_config.parallel_config
            parallel_state.init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method)
            parallel_state.initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
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
        attributes = {
            "pagedllm.num_reqs": len(scheduler_output.num_scheduled_tokens),
            "pagedllm.num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
        }
        with self._execute_span(attributes):
            self.runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        with self._sample_span(None):
            return self.runner.sample_tokens(grammar_output)

    def propose_draft_token_ids(self) -> dict[str, list[int]] | None:
        return self.runner.propose_draft_token_ids()

    # ------------------------------------------------------------------------- operations (RPC only)
    def sleep(self, level: int = 1) -> int:
        """Release the KV cache (level 1) and the weights (level 2); returns the bytes released."""
        if self._sleep is None:
            self._sleep = WorkerSleep(self.runner, self.engine_config)
        return self._sleep.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self._sleep is not None:
            self._sleep.wake_up(tags)

    def start_profile(self) -> None:
        self._require_profiler().start()

    def stop_profile(self) -> str:
        return self._require_profiler().stop()

    def _require_profiler(self) -> TorchProfiler:
        if self.profiler is None:
            raise ValueError(
                "profiling is not configured (set profiler_config.profiler='torch' and a torch_profiler_dir)"
            )
        return self.profiler

    @property
    def weight_updater(self) -> WeightUpdater:
        if self._weight_updater is None:
            model = self.runner.model
            if model is None:
                raise RuntimeError("Worker.load_model() must be called first")
            self._weight_updater = WeightUpdater(model, self.engine_config.weight_transfer_config)
        return self._weight_updater

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.weight_updater.init_transfer(init_info)

    def update_weights(self, update_info: dict[str, Any]) -> int:
        return self.weight_updater.update(update_info)

    def update_weights_from_disk(self, path: str) -> int:
        return self.weight_updater.update_from_disk(path)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.runner.require_lora().add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.require_lora().remove_adapter(lora_int_id)

    def list_loras(self) -> list[int]:
        return self.runner.require_lora().list_adapters()

    def shutdown(self) -> None:
        # Drop the model and caches so their memory is returned now, not at interpreter exit.
        self.model_runner = None
        # The step spans still queued (the process may end before the next batch export).
        flush_traces()
        if self.distributed_init_method is not None:
            parallel_state.destroy_model_parallel()
        if current_platform.is_cuda():
            torch.cuda.empty_cache()
