"""`GroupCoordinator`: one process group and the collectives the model and the runner use on it.

A thin layer over `torch.distributed` (gloo on the CPU, NCCL on CUDA for tensors; a gloo group beside
it for host-side data), so layers say `group.all_reduce(x)` and never handle process-group handles or
global-vs-group rank numbers. A group of one rank returns its input from every collective: the
single-process path pays nothing.

The sum and the gather are functional collectives (they return a new tensor and wait on it), which
`torch.compile` traces into its graph instead of breaking it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class GroupCoordinator:
    def __init__(self, ranks: list[int], rank: int) -> None:
        """Every rank of the world constructs every group (torch.distributed requires it); `rank`
        (this process's global rank) keeps the handles of the groups it belongs to."""
        self.ranks = ranks
        self.rank = rank
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank) if rank in ranks else -1
        self.device_group: Any = None
        self.cpu_group: Any = None
        if self.world_size > 1:
            self.device_group = dist.new_group(ranks)
            gloo = dist.get_backend() == "gloo"
            self.cpu_group = self.device_group if gloo else dist.new_group(ranks, backend="gloo")

    @classmethod
    def single(cls) -> GroupCoordinator:
        """A group of this process alone (no process group set up)."""
        return cls([0], 0)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return funcol.all_reduce(x, "sum", self.device_group)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        stacked = funcol.all_gather_single(x.contiguous(), 0, self.device_group)
        return torch.cat(stacked.chunk(self.world_size, 0), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of group rank `src` written into every rank's `x` (same shape and dtype everywhere)."""
        if self.world_size > 1:
            group = self.cpu_group if x.device.type == "cpu" else self.device_group
            dist.broadcast(x, src=self.ranks[src], group=group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to group rank `dst` (which receives it with `recv` of the same shape)."""
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[src], group=self.device_group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)
