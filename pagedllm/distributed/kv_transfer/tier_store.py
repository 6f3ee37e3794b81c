"""The offloading tier's block storage: `num_slots` rows of one KV block each.

On CUDA the tier is pinned host memory (fast asynchronous copies to and from the GPU). On the CPU the
primary pool is host memory already, so a second host copy would only split the same RAM: the tier is
a file on local disk, memory-mapped (the page cache keeps what is hot; the disk holds the rest), created
at its full size up front so it can never grow past `kv_offloading_size`. The file is unlinked as soon
as it is mapped: nothing is left behind, whatever way the process ends.
"""

from __future__ import annotations

import math
import os
import tempfile

import torch


def allocate_tier(
    num_slots: int, elems: int, dtype: torch.dtype, device: torch.device, disk_path: str | None
) -> torch.Tensor:
    """[num_slots, elems] storage for a tier serving a KV cache on `device`."""
    if device.type == "cuda":
        return torch.empty((num_slots, elems), dtype=dtype, pin_memory=True)
    numel = num_slots * elems
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    fd, path = tempfile.mkstemp(prefix="pagedllm-kv-tier-", suffix=".bin", dir=disk_path)
    try:
        os.ftruncate(fd, nbytes)
        store = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return store.view(num_slots, elems)


def num_tier_slots(size_bytes: float, bytes_per_block: int) -> int:
    """Blocks a tier of `size_bytes` holds; an error when not even one fits."""
    n = math.floor(size_bytes) // bytes_per_block
    if n < 1:
        raise ValueError(
            f"kv_offloading_size ({size_bytes / 2**30:.6f} GiB) holds no KV block of {bytes_per_block} bytes; "
            "raise it"
        )
    return n
