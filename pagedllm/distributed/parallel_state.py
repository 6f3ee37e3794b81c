"""The process groups of this worker and the layers' view of them.

A world of `tensor_parallel_size x pipeline_parallel_size` ranks, laid out as vLLM does: global rank
`pp_rank * tp + tp_rank`, so the ranks of one pipeline stage (one tensor-parallel group) are adjacent
and the ranks holding the same shard in successive stages form a pipeline group. Each group is a
`GroupCoordinator` (`pagedllm.distributed.communicator`): gloo on the CPU, NCCL on CUDA.

Without `initialize_model_parallel` (one process, the `uni` executor) the groups are worlds of one
rank whose collectives return their input, so the layers need no special case.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.distributed.communicator import GroupCoordinator

logger = logging.getLogger("pagedllm.distributed")

_TP: GroupCoordinator = GroupCoordinator.single()
_PP: GroupCoordinator = GroupCoordinator.single()
_WORLD: GroupCoordinator = GroupCoordinator.single()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_world_group() -> GroupCoordinator:
    return _WORLD


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


def check_tensor_parallel_size(tp_size: int) -> None:
    """Refuse building a model for a tensor-parallel size other than this process's group's."""
    if tp_size != get_tensor_model_parallel_world_size():
        raise NotImplementedError(
            f"tensor_parallel_size={tp_size}, but this process's tensor-parallel group has "
            f"{get_tensor_model_parallel_world_size()} rank(s): start the ranks through a multi-process "
            "executor (distributed_executor_backend='mp' or 'ray')"
        )


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel group."""
    return _TP.all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The tensor-parallel ranks' `x` concatenated along `dim`, in rank order."""
    return _TP.all_gather(x, dim)


def init_distributed_environment(
    world_size: int, rank: int, init_method: str, backend: str | None = None
) -> None:
    """Join the default process group (gloo on the CPU, NCCL on CUDA unless `backend` says)."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank)
    logger.info("rank %d of %d joined the %s process group", rank, world_size, backend)


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Split the default group into tensor- and pipeline-parallel groups (every rank calls this, with
    the same sizes, after `init_distributed_environment`)."""
    global _TP, _PP, _WORLD
    world, tp, pp = dist.get_world_size(), tensor_parallel_size, pipeline_parallel_size
    if world != tp * pp:
        raise ValueError(
            f"the world has {world} ranks, but tensor_parallel_size x pipeline_parallel_size = {tp} x {pp}"
        )
    rank = dist.get_rank()
    _WORLD = GroupCoordinator(list(range(world)), rank)
    # Every rank creates every group (torch.distributed requires it), keeping its own.
    for stage in range(pp):
        ranks = [stage * tp + i for i in range(tp)]
        group = GroupCoordinator(ranks, rank)
        if rank in ranks:
            _TP = group
    for shard in range(tp):
        ranks = [stage * tp + shard for stage in range(pp)]
        group = GroupCoordinator(ranks, rank)
        if rank in ranks:
            _PP = group


def destroy_model_parallel() -> None:
    """Leave every group (a worker's shutdown)."""
    global _TP, _PP, _WORLD
    _TP, _PP, _WORLD = GroupCoordinator.single(), GroupCoordinator.single(), GroupCoordinator.single()
    if dist.is_initialized():
        dist.destroy_process_group()


def output_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """The global rank that samples and whose results the executor returns: the first rank of the
    last pipeline stage (the stage holding the LM head)."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size


def max_concurrent_batches(parallel_config: Any) -> int:
    """How many batches the engine keeps in flight: one per pipeline stage under an executor that
    drives the workers from the engine (`mp`, `ray`), so the stages overlap; one otherwise (each
    `external_launcher` rank runs its own engine in lock-step with the others)."""
    pp = parallel_config.pipeline_parallel_size
    return pp if parallel_config.distributed_executor_backend in ("mp", "ray") else 1


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """`[start, end)` of the layers pipeline stage `pp_rank` holds (vLLM's rule): the sizes in
    `PAGEDLLM_PP_LAYER_PARTITION` when set, else `num_layers // pp_size` each with the remainder
    spread one layer each over the stages before the last (which also holds the LM head)."""
    raw = envs.PAGEDLLM_PP_LAYER_PARTITION
    if raw:
        try:
            sizes = [int(x) for x in raw.split(",")]
        except ValueError:
            raise ValueError(f"PAGEDLLM_PP_LAYER_PARTITION={raw!r} is not a comma-separated list of integers") from None
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise ValueError(
                f"PAGEDLLM_PP_LAYER_PARTITION={raw!r} must give {pp_size} positive layer counts summing to "
                f"{num_layers}"
            )
    else:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]
