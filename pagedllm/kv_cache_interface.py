"""The KV cache's shape, block budgeting and allocation, shared by the engine core (how many blocks a
budget holds), the worker and the draft models of speculative decoding (which allocate them) and the
KV connectors (which move them).

A `KVCacheSpec` says what one block holds in every attention layer; the worker measures the byte
budget (`pagedllm.worker.kv_cache`), the engine core turns it into a block count here.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """One entry per attention layer (layers may differ in KV heads / head size)."""

    block_size: int
    num_kv_heads: list[int]
    head_size: list[int]
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.num_kv_heads)

    @property
    def bytes_per_block(self) -> int:
        """Keys and values of `block_size` tokens in every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(2 * h * d * elem for h, d in zip(self.num_kv_heads, self.head_size))
        return per_token * self.block_size


def num_blocks_from_budget(budget_bytes: int, bytes_per_block: int, override: int | None) -> int:
    """The block count a byte budget allows (or `num_gpu_blocks_override` when set)."""
    if override is not None:
        return override
    return budget_bytes // bytes_per_block


def check_num_blocks(num_blocks: int, block_size: int, max_model_len: int, bytes_per_block: int) -> None:
    """Error clearly unless one sequence of `max_model_len` tokens fits in the cache."""
    needed = -(-max_model_len // block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens, "
            f"{num_blocks * bytes_per_block / 2**20:.1f} MiB), but one max_model_len={max_model_len} sequence "
            f"needs {needed} blocks ({needed * bytes_per_block / 2**20:.1f} MiB); raise kv_cache_memory_bytes "
            "(CPU) / gpu_memory_utilization (CUDA) or num_gpu_blocks_override, or lower max_model_len"
        )


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU it lives in anonymous mmap'd memory, which the OS hands out zeroed page by
    page on first touch: the cache costs RAM only for the blocks actually used, instead of `torch.zeros`
    writing (and so committing) the whole budget at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # torch.frombuffer keeps a reference to the mmap, so it lives as long as the tensor.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=numel).view(shape)
