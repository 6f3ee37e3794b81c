"""IPC weight transfer (`weight_transfer_config.backend='ipc'`): a trainer on the same machine shares
its tensors by handle; the engine maps them and copies them into its weights, no bytes go through a
socket or a collective.

The handles are those of torch's multiprocessing: CUDA IPC handles for CUDA tensors, and for CPU
tensors shared-memory files under the `file_system` sharing strategy (the storage moves into shared
memory once, on the trainer). `update_info` carries them as `ipc_handles`, plain data (JSON-ready):
one `{device id: SharedTensor}` dict per tensor (the device id is the GPU's UUID, or "cpu"), next to
the usual `names`, `dtype_names` and `shapes`. Each handle is decoded into the typed structs below and
checked (names, sizes, the view inside its storage) before torch maps it; nothing is unpickled, so an
`update_info` from a client can name shared memory, never run code. vLLM's `ipc_handles_pickled`
(pickled rebuild functions) is refused for that reason.

The trainer must keep its tensors alive until the engine's update call has returned.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, rebuild_storage_filename

from pagedllm.distributed.weight_transfer import TensorSpec, dtype_name, update_info_for

IPC_HANDLES_KEY = "ipc_handles"
PICKLED_HANDLES_KEY = "ipc_handles_pickled"
# torch names its shared-memory files `/torch_<pid>_<random>_<counter>`, and its shm manager's socket
# `<tmp>/torch-shm-dir-<random>/manager.sock`: a handle names those and nothing else.
_SHM_NAME = re.compile(r"/torch_\d+_\d+_\d+")
_SHM_DIR = Path("/dev/shm")
# torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: the int64 counters in one reference counter file.
_REF_COUNTERS_PER_FILE = 10000
# Larger than any storage (2^48 bytes): a bound that keeps the arithmetic below exact.
_MAX_BYTES = 1 << 48


class ShmStorage(msgspec.Struct, tag="shm", forbid_unknown_fields=True):
    """A CPU storage in a shared-memory file (torch's `file_system` sharing)."""

    manager: str  # the trainer's torch_shm_manager socket, which unlinks the file when all are done
    name: str  # the shared-memory file, "/torch_<pid>_<random>_<counter>"
    nbytes: int

    def open(self, name: str, device: torch.device) -> torch.UntypedStorage:
        if device.type != "cpu":
            raise ValueError(
                f"the IPC handle of {name!r} is a CPU shared-memory file; this engine runs on {device}"
            )
        self._check(name)
        return rebuild_storage_filename(
            torch.UntypedStorage, self.manager.encode(), self.name.encode(), self.nbytes
        )

    def _check(self, name: str) -> None:
        """A torch shared-memory file of at least the announced size, registered with a torch shm manager."""
        if not _SHM_NAME.fullmatch(self.name):
            raise ValueError(f"the IPC handle of {name!r} does not name a torch shared-memory file")
        manager = Path(self.manager)
        if not (
            manager.is_absolute()
            and manager.name == "manager.sock"
            and manager.parent.name.startswith("torch-shm-dir-")
            and ".." not in manager.parts
        ):
            raise ValueError(f"the IPC handle of {name!r} does not name a torch shm manager socket")
        try:
            is_socket = stat.S_ISSOCK(os.stat(manager).st_mode)
            size = os.stat(_SHM_DIR / self.name.lstrip("/")).st_size if _SHM_DIR.is_dir() else None
        except OSError as e:
            raise ValueError(f"the IPC handle of {name!r} names a file that is gone: {e.strerror}") from None
        if not is_socket:
            raise ValueError(f"the IPC handle of {name!r} does not name a torch shm manager socket")
        # A mapping larger than the file would grow it (or fault on reading past its end).
        if size is not None and size < self.nbytes:
            raise ValueError(f"the shared-memory file of {name!r} is smaller than its handle says")


class CudaStorage(msgspec.Struct, tag="cuda", forbid_unknown_fields=True):
    """A CUDA storage by IPC handle (what `UntypedStorage._share_cuda_` gives; bytes travel as base64)."""

    handle: bytes | None  # the cudaIpcMemHandle of the allocation holding the storage (None: empty)
    nbytes: int
    offset_bytes: int  # the storage's offset in that allocation
    ref_counter_handle: bytes  # the producer's shared counter, which keeps the block alive meanwhile
    ref_counter_offset: int
    event_handle: bytes | None  # an IPC event to wait on before reading (when event_sync_required)
    event_sync_required: bool

    def open(self, name: str, device: torch.device) -> torch.UntypedStorage:
        self._check(name)
        if device.type != "cuda":
            raise ValueError(f"the IPC handle of {name!r} is a CUDA handle; this engine runs on {device}")
        # The handle was picked by the GPU's UUID: open it on this process's index of that GPU.
        index = device.index if device.index is not None else torch.cuda.current_device()
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([self.nbytes]), (1,), 0, torch.storage.TypedStorage, torch.uint8, index,
            self.handle, self.nbytes, self.offset_bytes, False,
            self.ref_counter_handle, self.ref_counter_offset, self.event_handle, self.event_sync_required,
        )  # fmt: skip
        return tensor.untyped_storage()

    def _check(self, name: str) -> None:
        # torch's release of the mapping decrements the int64 at `ref_counter_offset` of the counter
        # file: both must be what torch makes, or a handle would write outside that file.
        if not _SHM_NAME.fullmatch(self.ref_counter_handle.decode(errors="replace")) or not (
            0 <= self.ref_counter_offset < _REF_COUNTERS_PER_FILE
        ):
            raise ValueError(f"the IPC handle of {name!r} has a bad reference counter")
        if (
            not 0 <= self.offset_bytes <= _MAX_BYTES
            or max(len(self.handle or b""), len(self.event_handle or b"")) > 256
        ):
            raise ValueError(f"the IPC handle of {name!r} has a bad offset or handle")


class SharedTensor(msgspec.Struct, forbid_unknown_fields=True):
    """One tensor: its dtype and shape (checked against the `update_info`'s), its storage's handle and
    the view inside it."""

    dtype: str
    shape: list[int]
    storage: ShmStorage | CudaStorage
    offset: int  # in elements of the dtype
    stride: list[int]

    def open(self, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """The tensor, mapped (ValueError naming it if the handle is not what `spec` announced, or its
        view does not lie inside its storage)."""
        if (self.dtype, tuple(self.shape)) != (dtype_name(spec.dtype), spec.shape):
            raise ValueError(
                f"the shared tensor {spec.name!r} is {self.dtype} {tuple(self.shape)}, but update_info "
                f"announced {dtype_name(spec.dtype)} {spec.shape}"
            )
        nbytes = self.storage.nbytes
        if not 0 <= nbytes <= _MAX_BYTES or len(self.stride) != len(spec.shape):
            raise ValueError(f"the IPC handle of {spec.name!r} has a bad size or stride")
        if self.offset < 0 or any(s < 0 for s in self.stride):
            raise ValueError(f"the IPC handle of {spec.name!r} has a negative offset or stride")
        last = self.offset + sum((n - 1) * s for n, s in zip(spec.shape, self.stride))
        if math.prod(spec.shape) and (last + 1) * spec.dtype.itemsize > nbytes:
            raise ValueError(f"the shared tensor {spec.name!r} does not fit its storage of {nbytes} bytes")
        try:
            storage = self.storage.open(spec.name, device)
        except RuntimeError as e:  # torch could not map it (the trainer exited, a stale handle)
            raise ValueError(f"the IPC handle of {spec.name!r} could not be opened: {e}") from None
        return torch.empty((0,), dtype=spec.dtype, device=device).set_(
            storage, self.offset, spec.shape, self.stride
        )


def device_id(device: torch.device) -> str:
    """Which handle of a tensor's `{device id: handle}` dict a process on `device` opens."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return device.type


def _share(tensor: torch.Tensor) -> SharedTensor:
    storage = tensor.untyped_storage()
    if tensor.device.type == "cuda":
        device, handle, nbytes, offset_bytes, counter, counter_offset, event, sync = storage._share_cuda_()
        shared: ShmStorage | CudaStorage = CudaStorage(
            handle, nbytes, offset_bytes, counter, counter_offset, event, sync
        )
    else:
        manager, name, nbytes = storage._share_filename_cpu_()
        # The engine's mapping takes this reference over (torch's own reduction does the same), so the
        # file outlives the trainer's tensor until the engine has copied it.
        storage._shared_incref()
        shared = ShmStorage(manager.decode(), name.decode(), nbytes)
    return SharedTensor(
        dtype_name(tensor.dtype), list(tensor.shape), shared, tensor.storage_offset(), list(tensor.stride())
    )


def trainer_ipc_update_info(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The trainer's `update_info` sharing `named_tensors` (keep them alive until the update returns):
    plain JSON-ready data, for `LLM.update_weights` or `POST /update_weights`."""
    handles = [{device_id(t.device): _share(t.detach())} for _, t in named_tensors]
    return {**update_info_for(named_tensors), IPC_HANDLES_KEY: msgspec.to_builtins(handles)}


def _decode_handles(update_info: dict[str, Any], count: int) -> list[dict[str, SharedTensor]]:
    if PICKLED_HANDLES_KEY in update_info:
        raise ValueError(
            f"update_info.{PICKLED_HANDLES_KEY} is not accepted (unpickling a client's bytes could run "
            f"code): send {IPC_HANDLES_KEY}, as trainer_ipc_update_info makes it"
        )
    if IPC_HANDLES_KEY not in update_info:
        raise ValueError(
            f"the ipc backend's update_info needs {IPC_HANDLES_KEY} (see trainer_ipc_update_info)"
        )
    try:
        handles = msgspec.convert(update_info[IPC_HANDLES_KEY], list[dict[str, SharedTensor]])
    except msgspec.ValidationError as e:
        raise ValueError(f"update_info.{IPC_HANDLES_KEY} is malformed: {e}") from None
    if len(handles) != count:
        raise ValueError(f"{IPC_HANDLES_KEY} must hold one handle per name ({count})")
    return handles


def open_ipc_tensors(
    update_info: dict[str, Any], specs: Sequence[TensorSpec], device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """Map every tensor of `update_info` (ValueError, before anything is loaded, if a handle is missing,
    malformed, or does not hold what its spec announced)."""
    handles = _decode_handles(update_info, len(specs))
    own = device_id(device)
    tensors = []
    for spec, per_device in zip(specs, handles):
        if own not in per_device:
            raise ValueError(
                f"no IPC handle of {spec.name!r} for this engine's device {own} (has {sorted(per_device)})"
            )
        tensors.append((spec.name, per_device[own].open(spec, device)))
    return tensors
