"""New weights into a loaded model, without a restart: pushed by an RL trainer over a transfer group
(`weight_transfer_config` backend 'nccl') or shared by handle from a trainer on the same machine
(backend 'ipc'), or read from a checkpoint directory (`update_weights_from_disk`).

Either way every tensor is checked against the model first (`check_weights`: name, shape, dtype,
through each parameter's own weight loader) and a refused update changes nothing; accepted tensors
then load through the same per-parameter weight loaders as at start-up (fused q/k/v and gate/up
included). The engine core resets the prefix cache afterwards (cached keys and values were computed
with the old weights).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.ipc_transfer import open_ipc_tensors
from pagedllm.distributed.weight_transfer import (
    DEFAULT_PACKED_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    TensorSpec,
    TransferGroup,
    engine_receive_weights,
    init_info_args,
    specs_from_update_info,
)
from pagedllm.errors import ModelLoadError
from pagedllm.models.loader.safetensors_loader import iterate_safetensors, read_header, safetensors_files
from pagedllm.models.loader.weights import check_weights, load_weights

logger = logging.getLogger("pagedllm.worker")

Named = tuple[str, torch.Tensor]


class WeightUpdater:
    def __init__(self, model: nn.Module, transfer_config: Any | None) -> None:
        self.model = model
        self.transfer_config = transfer_config
        self.group: TransferGroup | None = None
        extra = dict(transfer_config.extra) if transfer_config is not None else {}
        self.timeout_s = float(extra.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.packed_buffer_size_bytes = int(
            extra.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
        )

    @property
    def uses_ipc(self) -> bool:
        return self.transfer_config is not None and self.transfer_config.backend == "ipc"

    def init_transfer(self, init_info: dict[str, Any]) -> None:
        """Join the trainer's transfer group (blocks until both ends are there); nothing to join for
        the ipc backend, whose handles come with each update."""
        if self.transfer_config is None:
            raise ValueError(
                "weight updates from a trainer need weight_transfer_config (--weight-transfer-config)"
            )
        if self.uses_ipc:
            return
        address, port, world_size, timeout_s = init_info_args(init_info, self.timeout_s)
        rank = int(init_info.get("rank_offset", 1))
        self.group = TransferGroup(address, port, rank, world_size, timeout_s)
        logger.info("joined the weight transfer group at %s:%d as rank %d", address, port, rank)

    def update(self, update_info: dict[str, Any]) -> int:
        """Receive and load the tensors `update_info` announces; returns how many were loaded."""
        specs, received = self._receive_ipc(update_info) if self.uses_ipc else self._receive(update_info)
        with torch.no_grad():
            for bucket in received:
                load_weights(self.model, bucket, require_all=False)
        logger.info("weight update: %d tensors loaded", len(specs))
        return len(specs)

    def _receive(self, update_info: dict[str, Any]) -> tuple[list[TensorSpec], Iterable[list[Named]]]:
        """Over the transfer group: check, tell the trainer the verdict, then the buckets as they come."""
        if self.group is None:
            raise ValueError("init_weight_transfer_engine must be called before update_weights")
        group = self.group
        try:
            specs = specs_from_update_info(update_info)
            check_weights(self.model, [(s.name, s.shape, s.dtype) for s in specs])
        except ValueError:
            group.verdict(False, group.rank)  # the trainer learns of the refusal and sends nothing
            raise
        group.verdict(True, group.rank)
        size = int(update_info.get("packed_buffer_size_bytes", self.packed_buffer_size_bytes))
        return specs, engine_receive_weights(group, specs, size)

    def _receive_ipc(self, update_info: dict[str, Any]) -> tuple[list[TensorSpec], Iterable[list[Named]]]:
        """The trainer's shared tensors, all mapped and checked before the first is loaded."""
        specs = specs_from_update_info(update_info)
        check_weights(self.model, [(s.name, s.shape, s.dtype) for s in specs])
        device = next(self.model.parameters()).device
        return specs, [open_ipc_tensors(update_info, specs, device)]

    def update_from_disk(self, path: str) -> int:
        """Load every tensor of the safetensors checkpoint at `path` (a directory or one file)."""
        root = Path(path).expanduser()
        files = [root] if root.is_file() else safetensors_files(root)
        specs = [
            (name, shape, dtype) for f in files for name, (dtype, shape, _, _) in read_header(f)[0].items()
        ]
        if not specs:
            raise ModelLoadError(f"no tensors in {path}")
        check_weights(self.model, specs)
        with torch.no_grad():
            load_weights(self.model, iterate_safetensors(files), require_all=False)
        logger.info("weight update from %s: %d tensors loaded", path, len(specs))
        return len(specs)
