"""The `external_launcher` executor: a launcher such as `torchrun` starts every rank, and each rank's
process runs a whole engine (its own scheduler) with its one worker in-process.

The ranks run the same program on the same requests, so their schedulers make the same decisions;
what could differ is made equal here: the KV cache budget (the smallest of the ranks'), and the
sampled tokens (the output rank samples and broadcasts, see `worker.distributed_sampling`). The
process group comes from the launcher's environment (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`: `init_method="env://"`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.worker.worker import Worker


class ExternalLauncherExecutor(UniProcExecutor):
    def _make_worker(self) -> Worker:
        world = self.engine_config.parallel_config.world_size
        launched = int(envs.WORLD_SIZE or "0")
        if launched != world or envs.RANK is None:
            raise ValueError(
                f"distributed_executor_backend='external_launcher' needs a launcher (torchrun) to start "
                f"tensor_parallel_size x pipeline_parallel_size = {world} ranks; WORLD_SIZE={launched or 'unset'}"
            )
        rank, local_rank = int(envs.RANK), int(envs.LOCAL_RANK or "0")
        return Worker(self.engine_config, rank, local_rank, distributed_init_method="env://")

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        results = super().collective_rpc(method, args, kwargs, timeout)
        if method == "determine_available_kv_cache_bytes":
            # Every rank's scheduler must count the same blocks.
            budget = torch.tensor(results, dtype=torch.int64)
            dist.all_reduce(budget, op=dist.ReduceOp.MIN)
            results = budget.tolist()
        return results
