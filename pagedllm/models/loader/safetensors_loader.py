"""Safetensors checkpoints: memory-mapped, each tensor copied exactly once into its parameter.

The header is parsed here (it is 8 bytes of length + JSON), so a corrupt file fails with a clear
`ModelLoadError` before any allocation. Tensor data is viewed in place through a private read-only
mapping (`torch.frombuffer`, no copy); the model's weight loader then copies (and converts) it into the
parameter. After each tensor its pages are dropped from the mapping with `madvise(MADV_DONTNEED)`:
they stay in the page cache, but no longer count towards this process's resident memory, so peak RSS
while loading is about the model's own size instead of twice it.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from pagedllm.errors import ModelLoadError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # fp8 checkpoints' weights
    "F8_E5M2": torch.float8_e5m2,
}
# Far above any real header (names + shapes + offsets), small enough to refuse garbage lengths.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_PAGE = mmap.PAGESIZE

TensorInfo = tuple[torch.dtype, list[int], int, int]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint files of an HF directory: those named by `model.safetensors.index.json`
    (sharded), else every `*.safetensors`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt")
        )
        hint = f" (found {', '.join(others)}: PyTorch pickle checkpoints are not supported)" if others else ""
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """`({name: (dtype, shape, begin, end)}, data_start)`, validated against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise ModelLoadError(
                    f"{path}: corrupt safetensors file (shorter than its 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelLoadError(
                    f"{path}: corrupt safetensors header (header length {header_len} > file)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors header (invalid JSON: {e})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + header_len
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors header entry {name!r} ({e!r})") from None
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * dtype.itemsize:
            raise ModelLoadError(f"{path}: corrupt safetensors header entry {name!r} (offsets out of range)")
        tensors[name] = (dtype, shape, begin, end)
    return tensors, data_start


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` for every tensor; each tensor is a view of the mapped file, valid until the
    next one is requested (the consumer copies it into its parameter)."""
    headers = [(path, *read_header(path)) for path in files]  # validate every shard before loading any
    for path, tensors, data_start in headers:
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping, writable as torch.frombuffer wants, never written to.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if tensors else None
        try:
            for name, (dtype, shape, begin, end) in tensors.items():
                if begin == end:
                    yield name, torch.empty(shape, dtype=dtype)
                    continue
                assert mm is not None
                tensor = torch.frombuffer(
                    mm, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=data_start + begin
                )
                yield name, tensor.view(shape)
                del tensor
                start = (data_start + begin) // _PAGE * _PAGE
                mm.madvise(mmap.MADV_DONTNEED, start, data_start + end - start)
        finally:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    # A consumer still holds a view; the mapping closes when it is garbage collected.
                    pass
