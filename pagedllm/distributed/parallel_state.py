"""Tensor-parallel rank and world size, read by the layers that shard their weights.

Only a world of one rank exists today: `tensor_parallel_size > 1` is refused by the config
(`config/support.py`) and the executor before any layer is built, and again here by the loader. The
layers still shard by these two numbers, so a later process-group setup only has to set them.
"""

from __future__ import annotations

import torch

# (rank, world size) of this process in its tensor-parallel group.
_RANK = 0
_WORLD_SIZE = 1


def get_tensor_model_parallel_rank() -> int:
    return _RANK


def get_tensor_model_parallel_world_size() -> int:
    return _WORLD_SIZE


def check_tensor_parallel_size(tp_size: int) -> None:
    """Refuse a tensor-parallel size this process cannot run (any but its group's)."""
    if tp_size != get_tensor_model_parallel_world_size():
        raise NotImplementedError(
            f"tensor_parallel_size={tp_size} is not supported yet (only 1): no tensor-parallel group exists"
        )


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the tensor-parallel group."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    raise NotImplementedError("tensor-parallel all-reduce needs a process group, which is not set up yet")
