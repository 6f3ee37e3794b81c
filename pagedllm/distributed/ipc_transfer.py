"""IPC weight transfer (`weight_transfer_config.backend='ipc'`): a trainer on the same machine shares
its tensors by handle; the engine maps them and copies them into its weights, no bytes go through a
socket or a collective.

The handles are torch's own multiprocessing reductions (`reduce_tensor`): CUDA IPC handles for CUDA
tensors, and for CPU tensors shared-memory files under the `file_system` sharing strategy (the
storage moves into shared memory once, on the trainer). As in vLLM, `update_info` carries them as
`ipc_handles_pickled`: base64 of the pickled list with one `{device id: handle}` dict per tensor (the
device id is the GPU's UUID, or "cpu"), next to the usual `names`, `dtype_names` and `shapes`.

The trainer must keep its tensors alive until the engine's update call has returned. Unpickling runs
the handles' rebuild functions: only the engine's owner (the LLM API) or the server's dev-mode routes
accept an update, never a public route.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
from collections.abc import Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing.reductions import reduce_tensor

from pagedllm.distributed.weight_transfer import TensorSpec, update_info_for

IPC_HANDLES_KEY = "ipc_handles_pickled"


def device_id(device: torch.device) -> str:
    """Which handle of a tensor's `{device id: handle}` dict a process on `device` opens."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return device.type


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    # The default file_descriptor strategy hands out descriptors that only a multiprocessing child
    # can receive; a shared-memory file name can be opened by any process on the machine.
    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def trainer_ipc_update_info(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The trainer's `update_info` sharing `named_tensors` (keep them alive until the update returns)."""
    with _file_system_sharing():
        handles = [{device_id(t.device): reduce_tensor(t.detach())} for _, t in named_tensors]
        payload = bytes(ForkingPickler.dumps(handles))
    return {**update_info_for(named_tensors), IPC_HANDLES_KEY: base64.b64encode(payload).decode("ascii")}


def open_ipc_tensors(
    update_info: dict[str, Any], specs: Sequence[TensorSpec], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Map every tensor of `update_info` (ValueError, before anything is loaded, if a handle is missing
    or a tensor is not what its spec announced)."""
    payload = update_info.get(IPC_HANDLES_KEY)
    if not isinstance(payload, str):
        raise ValueError(
            f"the ipc backend's update_info needs {IPC_HANDLES_KEY} (see trainer_ipc_update_info)"
        )
    handles = pickle.loads(base64.b64decode(payload))
    if not isinstance(handles, list) or len(handles) != len(specs):
        raise ValueError(f"{IPC_HANDLES_KEY} must hold one handle per name ({len(specs)})")
    own = device_id(device)
    tensors = []
    for spec, per_device in zip(specs, handles):
        if own not in per_device:
            raise ValueError(
                f"no IPC handle of {spec.name!r} for this engine's device {own} (has {sorted(per_device)})"
            )
        rebuild, args = per_device[own]
        tensor = rebuild(*args)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"the shared tensor {spec.name!r} is {tensor.dtype} {tuple(tensor.shape)}, but update_info "
                f"announced {spec.dtype} {spec.shape}"
            )
        tensors.append((spec.name, tensor))
    return tensors
