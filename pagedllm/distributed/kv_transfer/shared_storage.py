"""SharedStorageConnector: KV blocks in a directory two instances share (vLLM's debugging connector for
disaggregated prefill, done here with validated, content-addressed files).

A producer (`kv_producer` / `kv_both`) writes each full block of a request's prompt, once computed, to
`<shared_storage_path>/<model fingerprint>/<block hash>.safetensors`. The block hash chains every earlier
token of the prompt (and the LoRA id), so a file is valid for any request with the same prefix. A
consumer (`kv_consumer` / `kv_both`) with the same model looks the request's block hashes up after its
local prefix hit, and loads the run of files it finds instead of computing their prefill.

Each file carries a CRC-32 of its data and the hash it was stored under; the scheduler side reads and
checks a file before it promises it, so a missing, truncated or corrupt file ends the hit there and
those tokens are recomputed. Files are written to a temporary name and renamed, so a reader never sees
half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from pagedllm.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorRole,
    elems_per_block,
    gather_blocks,
    scatter_blocks,
)

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.hashing import BlockHash
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.kv_cache_interface import KVCacheSpec

logger = logging.getLogger("pagedllm.kv_transfer")

DEFAULT_STORAGE_PATH = "local_storage"


@dataclass
class SharedStorageMetadata:
    # (block ids, [n, elems_per_block] data) to copy into the cache before the forward.
    loads: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    # Blocks the forward completes, to store after it: block ids and their hashes.
    save_block_ids: list[int] = field(default_factory=list)
    save_hashes: list[BlockHash] = field(default_factory=list)


def _checksum(data: torch.Tensor) -> int:
    return zlib.crc32(data.contiguous().view(torch.uint8).numpy())


class SharedStorageConnector(KVConnectorBase):
    def __init__(
        self, engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec, extra_config: Mapping[str, Any]
    ) -> None:
        super().__init__(engine_config, role, spec, extra_config)
        unknown = sorted(set(extra_config) - {"shared_storage_path"})
        if unknown:
            raise ValueError(
                f"SharedStorageConnector: unknown kv_connector_extra_config keys {unknown} "
                "(known: shared_storage_path)"
            )
        root = Path(extra_config.get("shared_storage_path", DEFAULT_STORAGE_PATH))
        mc = engine_config.model_config
        # Blocks of another model (or layout, or hash algorithm) with the same tokens must never match.
        identity = (
            str(mc.model),
            str(spec.dtype),
            spec.block_size,
            tuple(spec.num_kv_heads),
            tuple(spec.head_size),
            engine_config.cache_config.prefix_caching_hash_algo,
        )
        self.directory = root / hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.elems = elems_per_block(spec)
        # Scheduler side: req_id -> prompt blocks already saved (or found stored).
        self._pending_loads: list[tuple[list[int], torch.Tensor]] = []
        self._num_saved: dict[str, int] = {}

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}.safetensors"

    # ------------------------------------------------------------------ scheduler side
    def _read_block(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The stored block, or None if it is missing or fails any check (then it is recomputed)."""
        path = self._path(block_hash)
        try:
            raw = path.read_bytes()
            header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            meta = header.get("__metadata__", {})
            data = safetensors.torch.load(raw)["kv"]
            ok = (
                meta.get("block_hash") == block_hash.hex()
                and data.dtype == self.spec.dtype
                and data.shape == (self.elems,)
                and int(meta.get("crc32", -1)) == _checksum(data)
            )
        except FileNotFoundError:
            return None
        except Exception as e:  # any unreadable file is a miss, never an error of the request
            logger.warning("stored KV block %s is unreadable (%s); it will be recomputed", path.name, e)
            return None
        if not ok:
            logger.warning("stored KV block %s fails its checks; it will be recomputed", path.name)
            return None
        return data

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if not self.is_consumer:
            return 0
        return self._find_run(request, num_computed_tokens, self._read_block)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        found = self._take_found(request, num_external_tokens)
        if found is None:
            return
        start, blocks = found
        self._pending_loads.append((block_ids[start : start + len(blocks)], torch.stack(blocks)))
        # What was loaded is stored already.
        self._num_saved[request.request_id] = start + len(blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        meta = SharedStorageMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.is_producer:
            return meta
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests[req_id]
            # num_computed_tokens already counts this step's tokens: the forward completes these blocks.
            done = min(
                min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size,
                len(request.block_hashes),
            )
            first = self._num_saved.get(req_id, 0)
            if done <= first:
                continue
            block_ids = self.kv_cache_manager.get_block_ids(req_id)
            for i in range(first, done):
                block_hash = request.block_hashes[i]
                if not self._path(block_hash).exists():
                    meta.save_block_ids.append(block_ids[i])
                    meta.save_hashes.append(block_hash)
            self._num_saved[req_id] = done
        return meta

    def request_finished(self, request: Request) -> None:
        super().request_finished(request)
        self._num_saved.pop(request.request_id, None)

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, metadata: SharedStorageMetadata) -> None:
        assert self._jobs is not None
        for block_ids, data in metadata.loads:

            def load(block_ids: list[int] = block_ids, data: torch.Tensor = data) -> None:
                start = time.perf_counter()
                scatter_blocks(self.kv_caches, block_ids, data)
                self._count("load_time_s", time.perf_counter() - start)
                self._count("bytes_loaded", data.numel() * data.element_size())

            self._jobs.submit(load)

    def save_kv(self, metadata: SharedStorageMetadata) -> None:
        if not metadata.save_block_ids:
            return
        assert self._jobs is not None
        # Snapshot now: once the step ends, a freed block may be reused and overwritten.
        data = gather_blocks(self.kv_caches, metadata.save_block_ids).cpu()
        hashes = metadata.save_hashes

        def save() -> None:
            start = time.perf_counter()
            saved = 0
            for row, block_hash in zip(data, hashes):
                try:
                    self._write_block(block_hash, row.clone())
                    saved += row.numel() * row.element_size()
                except OSError as e:
                    # A block not stored is only a block a consumer recomputes: never fail the request.
                    logger.warning("could not store KV block %s: %s", block_hash.hex(), e)
            self._count("save_time_s", time.perf_counter() - start)
            self._count("bytes_saved", saved)

        self._jobs.submit(save)

    def _write_block(self, block_hash: BlockHash, row: torch.Tensor) -> None:
        path = self._path(block_hash)
        meta = {"block_hash": block_hash.hex(), "crc32": str(_checksum(row))}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(safetensors.torch.save({"kv": row}, metadata=meta))
        os.replace(tmp, path)
