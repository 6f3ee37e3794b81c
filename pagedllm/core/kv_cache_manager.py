"""Per-request block tables on top of the block pool, and prefix-cache lookups.

Every KV block of the cache is usable (there is no reserved null block): block ids run from 0 to
num_blocks - 1, exactly the dim-1 indices of the runner's cache tensors.
"""

from __future__ import annotations

from pagedllm.core.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_events import KVCacheEvent, KVEventRecorder
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        # Without prefix caching no block is ever registered: there would be nothing to report.
        self.kv_events = KVEventRecorder(block_size) if enable_kv_cache_events and enable_caching else None
        self.block_pool = BlockPool(num_blocks, self.kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache already, so each
        # allocation only looks at the blocks that filled up since.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics since the last `take_prefix_cache_stats()`, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request, and its length in tokens.

        At most num_tokens - 1 tokens come from the cache: the last token must run through the model to
        produce the logits of the next one. Requests asking for prompt logprobs get no hit (the runner
        computes those only for the positions it runs)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        hits: list[KVCacheBlock] = []
        get_cached = self.block_pool.get_cached_block
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_cache_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (the scheduler calls it once per admitted request, so a request
        that waits for several steps is not counted several times)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(queries, hits) since the last call; the counters restart from zero."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of the request (after its computed tokens and the
        `num_new_computed_tokens` prefix hits `new_computed_blocks`, which join its block table).

        Returns the newly allocated blocks (possibly none), or None when the pool cannot supply them;
        then nothing changed. Full blocks are registered in the prefix cache right away: the runner writes
        their KV in this step, before any later step can read them, and within one step every layer writes
        the cache before it attends."""
        if num_new_tokens <= 0:
            raise ValueError(f"allocate_slots needs num_new_tokens > 0, got {num_new_tokens}")
        computed_blocks = new_computed_blocks or []
        req_id = request.request_id
        req_blocks = self.req_to_blocks.get(req_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_needed_tokens = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = cdiv(num_needed_tokens, self.block_size) - num_held - len(computed_blocks)
        # (Most decode steps need no new block: skip the free-count check for them.)
        if num_new_blocks > 0 and num_new_blocks > self._num_allocatable_blocks(computed_blocks):
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[req_id] = []
        if computed_blocks:
            self.block_pool.touch(computed_blocks)
            req_blocks.extend(computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            num_full = min((num_computed + num_new_tokens) // self.block_size, len(request.block_hashes))
            num_cached = self.num_cached_blocks.get(req_id, 0)
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full, request
                )
                self.num_cached_blocks[req_id] = num_full
        return new_blocks

    def _num_allocatable_blocks(self, computed_blocks: list[KVCacheBlock]) -> int:
        # Hits with no other user sit in the free list: taking them uses up free blocks too.
        num_evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return self.block_pool.get_num_free_blocks() - num_evictable_hits

    def can_fit(self, request: Request, computed_blocks: list[KVCacheBlock]) -> bool:
        """Whether blocks for all of a waiting request's tokens beyond its prefix hits `computed_blocks`
        are free now."""
        num_new_blocks = cdiv(request.num_tokens, self.block_size) - len(computed_blocks)
        return num_new_blocks <= self._num_allocatable_blocks(computed_blocks)

    def uncache_unscheduled_blocks(self, request: Request) -> None:
        """Withdraw the blocks `allocate_slots` registered this step, for a request whose step is undone
        before it ran: their KV is never written, so a later prefix hit on them would read garbage.
        (`request.num_computed_tokens` must still be the value from before this step.)"""
        req_id = request.request_id
        num_cached = self.num_cached_blocks.get(req_id, 0)
        num_valid = request.num_computed_tokens // self.block_size
        if num_cached > num_valid:
            self.block_pool.uncache_blocks(self.req_to_blocks[req_id][num_valid:num_cached])
            self.num_cached_blocks[req_id] = num_valid

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: when they are evicted later, the ends of sequences
        go before the prefixes other requests are likelier to share."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """The KV cache events since the last call (none while events are off)."""
        return self.kv_events.take_events() if self.kv_events is not None else []
