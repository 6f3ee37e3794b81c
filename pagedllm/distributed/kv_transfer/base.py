"""The KV connector interface (vLLM V1's `KVConnectorBase_V1`, reduced to what pagedllm's engine calls).

A connector lives twice: once beside the scheduler (role SCHEDULER) and once beside the model runner
(role WORKER). They share nothing but the metadata object the scheduler side builds each step, which
rides on the `SchedulerOutput` to the runner, and the stats the worker side hands back.

Scheduler side, in the order the scheduler calls it:
  `get_num_new_matched_tokens` (how many tokens after the local prefix hit the connector can supply),
  `update_state_after_alloc` (the blocks those tokens will be loaded into),
  `build_connector_meta` (once per step: what the worker loads and saves),
  `request_finished`, `reset_cache`.
Worker side, around the forward: `start_load_kv` (right after the step's states are applied, so the
copies overlap the input preparation), `wait_for_load` (just before the forward), `save_kv` (after the
forward: snapshot the step's blocks and write them in the background, overlapping logits and sampling),
`wait_for_save` (at the end of the step, so a finished request's blocks are stored before its output
leaves), `take_stats`. The overlap is where the platform copies beside the forward (CUDA); on the CPU the
copies run inline (`Platform.supports_background_kv_copies`).

A load can never be half-applied: whatever the scheduler side promised has been validated before it
promised it, so a missing or corrupt stored block becomes a smaller (or no) hit - recompute, never wrong
output.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.platforms import current_platform

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.core.hashing import BlockHash
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import SchedulerOutput
    from pagedllm.kv_cache_interface import KVCacheSpec


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase:
    """Defaults do nothing, so a connector implements only the side(s) it needs."""

    # Why a producer- or consumer-only role makes sense: a prefill instance never loads, a decode
    # instance never saves. Connectors that serve both always (the offloading tier) ignore the role.
    def __init__(
        self, engine_config: EngineConfig, role: KVConnectorRole, spec: KVCacheSpec, extra_config: Mapping[str, Any]
    ) -> None:
        self.engine_config = engine_config
        self.role = role
        self.spec = spec
        self.extra_config = dict(extra_config)
        self.block_size = spec.block_size
        kv = engine_config.kv_transfer_config
        self.kv_role = kv.kv_role if kv is not None else None
        self.kv_caches: list[torch.Tensor] = []
        # Worker side: where the copies run (a thread of their own where the platform copies beside the
        # forward, else inline) and the stats since the last `take_stats`.
        self._jobs = (
            BackgroundJobs(f"kv-{type(self).__name__}", current_platform.supports_background_kv_copies())
            if role == KVConnectorRole.WORKER
            else None
        )
        self._stats: dict[str, float] = {}
        # Scheduler side: req_id -> (first block index, what the last lookup found for each block).
        self._found: dict[str, tuple[int, list[Any]]] = {}

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    # ------------------------------------------------------------------ scheduler side
    def bind_scheduler(self, requests: Mapping[str, Request], kv_cache_manager: KVCacheManager) -> None:
        """The scheduler's live request table and cache manager (read, never changed, by the connector)."""
        self.requests = requests
        self.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first `num_computed_tokens` (the local prefix hit) the connector can load;
        at most num_tokens - 1 (the last token must run through the model) and whole blocks only."""
        return 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request was admitted: `block_ids` is its whole block table, and the `num_external_tokens`
        the connector promised go into the blocks after its local hit."""

    def _find_run(
        self, request: Request, num_computed_tokens: int, find: Callable[[BlockHash], Any | None]
    ) -> int:
        """The run of blocks after the local hit that `find` has (it stops at the first None), in
        tokens; what was found is kept for `_take_found`."""
        self._found.pop(request.request_id, None)
        start = num_computed_tokens // self.block_size
        found: list[Any] = []
        for block_hash in request.block_hashes[start : max_loadable_blocks(request, self.block_size)]:
            item = find(block_hash)
            if item is None:
                break
            found.append(item)
        if found:
            self._found[request.request_id] = (start, found)
        return len(found) * self.block_size

    def _take_found(self, request: Request, num_external_tokens: int) -> tuple[int, list[Any]] | None:
        """(first block index, found items) of the blocks the scheduler admitted the request with."""
        found = self._found.pop(request.request_id, None)
        if found is None or num_external_tokens == 0:
            return None
        start, items = found
        return start, items[: num_external_tokens // self.block_size]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """What the worker side does this step; the scheduler side forgets it afterwards."""
        return None

    def request_finished(self, request: Request) -> None:
        """The request ended (finished, aborted); its blocks are freed right after."""
        self._found.pop(request.request_id, None)

    def reset_cache(self) -> None:
        """The prefix cache was reset: drop what the connector holds (where it holds anything)."""

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's per-layer caches, laid out [2, num_blocks, kv_heads, block_size, head_size]."""
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: Any) -> None:
        """Begin this step's copies into the cache (they may run in the background)."""

    def wait_for_load(self) -> None:
        """Block until the copies `start_load_kv` began are in the cache."""
        if self._jobs is not None:
            self._jobs.wait()

    def save_kv(self, metadata: Any) -> None:
        """After the forward: begin storing what the step computed."""

    def wait_for_save(self) -> None:
        """Block until `save_kv`'s writes are done."""
        if self._jobs is not None:
            self._jobs.wait()

    def _count(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0.0) + value

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call (bytes_loaded, bytes_saved, load_time_s, save_time_s)."""
        stats, self._stats = self._stats, {}
        return stats

    def shutdown(self) -> None:
        """Release what the connector holds (threads, files)."""
        if self._jobs is not None:
            self._jobs.shutdown()


class BackgroundJobs:
    """A connector's copies, in submission order: on one worker thread of their own where `background`
    (they overlap the runner's host work while a copy engine moves the bytes; torch's copy kernels
    release the GIL), else run at once in the caller, failures kept for `wait` all the same."""

    def __init__(self, name: str, background: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name) if background else None
        self._pending: list[Future[None]] = []

    def submit(self, job: Callable[[], None]) -> None:
        if self._pool is not None:
            self._pending.append(self._pool.submit(job))
            return
        future: Future[None] = Future()
        try:
            job()
            future.set_result(None)
        except BaseException as e:  # re-raised by wait(), as a background job's would be
            future.set_exception(e)
        self._pending.append(future)

    def wait(self) -> None:
        """Wait for every submitted job; re-raise the first failure (the step must not go on with a
        cache that was not filled)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _layer_views(
    kv_caches: list[torch.Tensor], rows: torch.Tensor
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: the cache as [2, num_blocks, block elems] and the matching columns of `rows`
    ([n, elems_per_block], layers side by side) as [n, 2, block elems]. Both are views: copying between
    them moves each layer's bytes once, with no intermediate per-layer tensors or concatenation."""
    offset = 0
    for cache in kv_caches:
        layer = cache.flatten(2)
        width = layer.shape[0] * layer.shape[2]
        yield layer, rows[:, offset : offset + width].view(rows.shape[0], layer.shape[0], -1)
        offset += width


def _index(block_ids: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(block_ids, dtype=torch.int64).to(device)


def save_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], store: torch.Tensor, slots: list[int]
) -> None:
    """Copy every layer's keys and values of `block_ids` into rows `slots` of `store` (any device)."""
    index, rows = _index(block_ids, kv_caches[0].device), _index(slots, store.device)
    for layer, dst in _layer_views(kv_caches, store):
        dst[rows] = layer.index_select(1, index).transpose(0, 1).to(store.device, store.dtype)


def load_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], store: torch.Tensor, slots: list[int] | torch.Tensor
) -> None:
    """The inverse of `save_blocks`: write rows `slots` of `store` (any device) into the given blocks."""
    index, rows = _index(block_ids, kv_caches[0].device), _index(slots, store.device)
    for layer, src in _layer_views(kv_caches, store):
        layer[:, index] = src[rows].transpose(0, 1).to(layer.device, layer.dtype)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """[len(block_ids), elems_per_block] on the cache's device: every layer's keys and values of each
    block, flattened and placed layer after layer (layers may differ in heads and head size)."""
    width = sum(cache[:, 0].numel() for cache in kv_caches)
    out = torch.empty((len(block_ids), width), dtype=kv_caches[0].dtype, device=kv_caches[0].device)
    save_blocks(kv_caches, block_ids, out, list(range(len(block_ids))))
    return out


def scatter_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], data: torch.Tensor) -> None:
    """The inverse of `gather_blocks`: write rows of `data` (on any device) into the given blocks."""
    load_blocks(kv_caches, block_ids, data, torch.arange(len(block_ids)))


def elems_per_block(spec: KVCacheSpec) -> int:
    return sum(2 * h * d for h, d in zip(spec.num_kv_heads, spec.head_size)) * spec.block_size


def max_loadable_blocks(request: Request, block_size: int) -> int:
    """Blocks a connector may supply for the request: full hashed blocks short of the last token. A
    request asking for prompt logprobs gets none (the runner computes those only where it runs)."""
    if request.sampling_params.prompt_logprobs is not None:
        return 0
    return min((request.num_tokens - 1) // block_size, len(request.block_hashes))
