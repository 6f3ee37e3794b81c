"""Weight transfer from an RL trainer process into a running engine (`weight_transfer_config`).

Both ends join one two-rank process group of their own (a TCP store and a gloo group on CPU, NCCL on
CUDA: the platform's `dist_backend`), not torch's default group, so neither side's other
distributed state is touched. The trainer is rank 0 and hosts the store; the engine's worker is
rank `rank_offset` (1).

One update, both ends walking the same list of `(name, dtype, shape)` in the same order:
1. the engine checks every name and shape against its model (`check_weights`) and broadcasts its
   verdict (one int64): a refused update moves no bytes, and the trainer's send raises too;
2. the tensors go in buckets of at most `packed_buffer_size_bytes` (a larger tensor alone), each
   packed into one flat byte buffer and broadcast by the trainer; the engine unpacks each bucket and
   loads it through the parameters' weight loaders before receiving the next.

Names are the checkpoint's (HF) names: the engine folds them into its fused parameters as at load time.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.platforms import current_platform

# Default bucket size: large enough that per-broadcast latency does not dominate, small enough that the
# staging buffer is a small fraction of any model.
DEFAULT_PACKED_BUFFER_BYTES = 64 * 2**20
DEFAULT_TIMEOUT_S = 300.0
TRAINER_RANK = 0
_ACCEPT, _REFUSE = 1, 0


class WeightUpdateRefused(ValueError):
    """The engine refused the update (a wrong name, shape or dtype): nothing was applied."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_dtype(name: str) -> torch.dtype:
    """`"float32"` / `"torch.bfloat16"` -> the torch dtype (ValueError naming it otherwise)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in the weight update")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (what `update_info`'s `dtype_names` hold)."""
    return str(dtype).removeprefix("torch.")


def specs_from_update_info(update_info: dict[str, Any]) -> list[TensorSpec]:
    """The tensors an update announces: `names`, `dtype_names` and `shapes`, parallel lists."""
    try:
        names, dtypes, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
    except KeyError as e:
        raise ValueError(f"update_info needs names, dtype_names and shapes (missing {e})") from None
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"update_info lists {len(names)} names, {len(dtypes)} dtype_names and {len(shapes)} shapes"
        )
    return [TensorSpec(n, parse_dtype(d), tuple(int(x) for x in s)) for n, d, s in zip(names, dtypes, shapes)]


def update_info_for(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The `update_info` announcing `named_tensors` (what the trainer hands the engine's update call)."""
    return {
        "names": [name for name, _ in named_tensors],
        "dtype_names": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
    }


def buckets(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[int]]:
    """Indices of `specs` grouped in order into buckets of at most `max_bytes` (a larger tensor alone)."""
    groups: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        if not groups or size + spec.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += spec.nbytes
    return groups


class TransferGroup:
    """A two-rank process group outside torch's default one (trainer rank 0, engine rank 1)."""

    def __init__(
        self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"weight transfer group: rank {rank} of world_size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank = rank
        self.store = dist.TCPStore(
            master_address, int(master_port), world_size, rank == TRAINER_RANK, timeout
        )
        self.backend = current_platform.dist_backend
        self.device = (
            torch.device("cpu")
            if self.backend == "gloo"
            else torch.device("cuda", torch.cuda.current_device())
        )
        if self.backend == "gloo":
            self.group: Any = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.group.broadcast(tensor, src).wait()

    def verdict(self, accept: bool | None, engine_rank: int) -> bool:
        """The engine's accept/refuse, known to both ends (`accept` is None on the trainer)."""
        flag = torch.tensor([_ACCEPT if accept else _REFUSE], dtype=torch.int64, device=self.device)
        self.broadcast(flag, engine_rank)
        return int(flag.item()) == _ACCEPT


def init_info_args(init_info: dict[str, Any], default_timeout_s: float) -> tuple[str, int, int, float]:
    """`(master_address, master_port, world_size, timeout_s)` from an `init_info` dict."""
    try:
        address, port = str(init_info["master_address"]), int(init_info["master_port"])
    except KeyError as e:
        raise ValueError(f"init_info needs master_address and master_port (missing {e})") from None
    return (
        address,
        port,
        int(init_info.get("world_size", 2)),
        float(init_info.get("timeout_s", default_timeout_s)),
    )


def trainer_init(init_info: dict[str, Any]) -> TransferGroup:
    """The trainer's end (rank 0, hosting the store); blocks until the engine joins."""
    address, port, world_size, timeout_s = init_info_args(init_info, DEFAULT_TIMEOUT_S)
    return TransferGroup(address, port, TRAINER_RANK, world_size, timeout_s)


def trainer_send_weights(
    group: TransferGroup,
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES,
    engine_rank: int = 1,
) -> None:
    """Send `named_tensors` (the order of the `update_info` the engine was given); raises
    WeightUpdateRefused when the engine refused them."""
    if not group.verdict(None, engine_rank):
        raise WeightUpdateRefused(
            "the engine refused the weight update (see the engine's error); nothing was sent"
        )
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named_tensors]
    for bucket in buckets(specs, packed_buffer_size_bytes):
        flat = [named_tensors[i][1].detach().contiguous().reshape(-1).view(torch.uint8) for i in bucket]
        packed = torch.cat(flat).to(group.device)
        group.broadcast(packed, TRAINER_RANK)


def engine_receive_weights(
    group: TransferGroup, specs: Sequence[TensorSpec], packed_buffer_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The engine's end of one accepted update: each bucket's `(name, tensor)`s, valid until the next."""
    for bucket in buckets(specs, packed_buffer_size_bytes):
        packed = torch.empty(sum(specs[i].nbytes for i in bucket), dtype=torch.uint8, device=group.device)
        group.broadcast(packed, TRAINER_RANK)
        out, offset = [], 0
        for i in bucket:
            spec = specs[i]
            raw = packed[offset : offset + spec.nbytes]
            # A view needs the offset aligned to the dtype (a bfloat16 tensor of odd size before a float32).
            raw = raw if offset % spec.dtype.itemsize == 0 else raw.clone()
            out.append((spec.name, raw.view(spec.dtype).view(spec.shape)))
            offset += spec.nbytes
        yield out
